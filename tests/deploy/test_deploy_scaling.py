"""The scale-out deployment files, checked without a cluster or a Docker engine: docker-compose.yml's
`scale` profile and deploy/kubernetes put every replica behind the router, with arguments sglang-router's
own parser accepts, readiness on /health, a grace period longer than the drain, and stated resources."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from .test_deploy_files import compose, hadolint_binary

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
WORKER = {"app.kubernetes.io/name": "ktserve", "app.kubernetes.io/component": "worker"}


def parse_router_args(args: list[str]):
    launch = pytest.importorskip("sglang_router.launch_router", reason="sglang-router is not installed")
    return launch.parse_router_args(args)


def scale_services() -> dict[str, dict]:
    return {name: svc for name, svc in compose()["services"].items() if "scale" in svc.get("profiles", [])}


def compose_router_args() -> list[str]:
    """The router's arguments as its shell runs them, with the API key set."""
    script = scale_services()["router"]["command"][0].replace("$$", "$")
    words = subprocess.run(["sh", "-c", f'printf "%s\\n" {script.removeprefix("exec ")}'],
                           env={"API_KEY": "sk-example"}, capture_output=True, text=True, check=True).stdout
    return words.splitlines()[3:]  # after `python3 -m sglang_router.launch_router`


def manifests() -> list[dict]:
    return [doc for path in sorted(KUBERNETES.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifest(kind: str, name: str) -> dict:
    return next(m for m in manifests() if m["kind"] == kind and m["metadata"]["name"] == name)


def container(deployment: str) -> dict:
    return manifest("Deployment", deployment)["spec"]["template"]["spec"]["containers"][0]


def test_compose_router_lists_every_replica_of_the_scale_profile():
    replicas = {name for name in scale_services() if name != "router"}
    args = parse_router_args(compose_router_args())
    assert set(args.worker_urls) == {f"http://{name}:8000" for name in replicas}
    assert len(replicas) >= 2


def test_compose_router_passes_the_api_key_from_the_env_file():
    assert parse_router_args(compose_router_args()).api_key == "sk-example"


def test_compose_replicas_serve_one_model_id():
    ids = {svc["environment"]["API_MODEL_NAME"] for name, svc in scale_services().items() if name != "router"}
    assert len(ids) == 1


def test_compose_replicas_outlast_their_drain():
    for name, svc in scale_services().items():
        if name != "router":
            assert svc["stop_grace_period"] == "45s"  # graceful_timeout is 30 s


def test_router_image_passes_hadolint():
    result = subprocess.run([hadolint_binary(), "--no-color", "--config", str(ROOT / ".hadolint.yaml"),
                             str(ROOT / "deploy" / "router" / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_kubernetes_router_discovers_the_worker_pods():
    args = parse_router_args(container("ktserve-router")["args"])
    labels = manifest("Deployment", "ktserve")["spec"]["template"]["metadata"]["labels"]
    assert args.service_discovery and args.selector == WORKER == labels
    assert args.service_discovery_port == container("ktserve")["ports"][0]["containerPort"]


def test_kubernetes_router_may_watch_pods():
    rules = manifest("Role", "ktserve-router")["rules"]
    assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"]) for r in rules)


def test_kubernetes_replicas_are_ready_only_while_health_says_so():
    probe = container("ktserve")["readinessProbe"]["httpGet"]
    assert probe["path"] == "/health"


def test_kubernetes_grace_period_outlasts_the_drain():
    config = yaml.safe_load(manifest("ConfigMap", "ktserve-config")["data"]["server.yaml"])
    grace = manifest("Deployment", "ktserve")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > config["graceful_timeout"]


@pytest.mark.parametrize("deployment", ["ktserve", "ktserve-router"])
def test_kubernetes_containers_state_cpu_and_memory(deployment):
    requests = container(deployment)["resources"]["requests"]
    assert {"cpu", "memory"} <= set(requests)


def test_kubernetes_replica_asks_for_one_gpu():
    resources = container("ktserve")["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1


def test_kubernetes_api_key_comes_from_a_secret():
    for deployment in ("ktserve", "ktserve-router"):
        env = {e["name"]: e for e in container(deployment)["env"]}
        assert env["API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "ktserve-api-key"


def test_kustomization_lists_every_manifest():
    listed = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")

