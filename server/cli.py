"""The `ktserve` command: serve, make-demo-model, eval."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

log = logging.getLogger("ktserve")

DEMO_MODEL_NAME = "ktserve-demo"


def _adapter_pair(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--adapter expects NAME=PATH, got {value!r}")
    return name, path


def _serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server",
                       description="Start the server. With no model it serves the built-in demo model.")
    p.add_argument("config", nargs="?", help="YAML config file (LLaMA-Factory key names accepted)")
    p.add_argument("--model", help="model directory (default: the built-in demo model)")
    p.add_argument("--served-model-name", help="the model id clients use (env API_MODEL_NAME)")
    p.add_argument("--engine", help="huggingface | ktransformers | vllm (LLaMA-Factory: infer_backend)")
    p.add_argument("--host", help="address to bind (env API_HOST; default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (env API_PORT; default 8000)")
    p.add_argument("--api-key", help="require this key on /v1 routes (env API_KEY)")
    p.add_argument("--max-concurrent", type=int, help="requests generating at once (env MAX_CONCURRENT)")
    p.add_argument("--max-queue", type=int, help="waiting requests beyond which new ones get 429")
    p.add_argument("--max-model-len", type=int, help="context length limit (LLaMA-Factory: kt_maxlen)")
    p.add_argument("--request-timeout", type=float, help="seconds before a request is ended with an error")
    p.add_argument("--graceful-timeout", type=float,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are ended (default 30)")
    p.add_argument("--metrics-public", action="store_const", const=True,
                   help="serve /metrics without the API key")
    p.add_argument("--max-body-bytes", type=int, help="largest accepted request body")
    p.add_argument("--read-timeout", type=float,
                   help="seconds a client gets to send a whole request before it is disconnected (default 30)")
    p.add_argument("--device", help="auto | cpu | cuda | cuda:N (huggingface engine)")
    p.add_argument("--dtype", help="auto | bfloat16 | float16 | float32")
    p.add_argument("--template", help="built-in chat template: deepseek | deepseek3 | deepseekr1")
    p.add_argument("--adapter", action="append", type=_adapter_pair, metavar="NAME=PATH",
                   help="LoRA adapter to load at start (repeatable)")
    p.add_argument("--adapter-root", action="append", metavar="DIR",
                   help="directory runtime adapter loads may come from (repeatable)")
    p.add_argument("--kt-optimize-rule", help="placement rule file (ktransformers engine)")
    p.add_argument("--cpu-infer", type=int, help="CPU expert threads (default: physical cores - max(2, cores / 8))")
    p.add_argument("--chunk-size", type=int, help="prefill chunk size in tokens")
    p.add_argument("--kt-method", help="experts method for every layer: AMXINT8 | AMXINT4 | BF16 | FP8 | RAWINT4 | "
                                       "LLAMAFILE (default: the rules' choice, or the closest this CPU runs)")
    p.add_argument("--kt-strict-placement", action="store_true", default=None,
                   help="refuse rule files naming GPUs this machine lacks instead of folding them")
    p.add_argument("--kt-weight-cache", help="directory for pre-quantized expert weights")
    p.add_argument("--kv-cache-tokens", type=int, help="KV cache capacity in tokens (ktransformers engine)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_const", const=False,
                   help="compute every prompt whole instead of reusing cached KV pages of a shared prefix")
    p.add_argument("--attention-backend", choices=["auto", "flashinfer", "torch"],
                   help="MLA attention on CUDA: flashinfer, torch, or auto (flashinfer where it runs; default)")
    p.add_argument("--reasoning-parser", help="deepseek_r1: split <think> text into reasoning_content")
    p.add_argument("--cors-origin", action="append", dest="cors_origins", help="allowed CORS origin (repeatable)")
    p.add_argument("--log-format", choices=["text", "json"])
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])


def _cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    keys = ["model", "served_model_name", "engine", "host", "port", "api_key", "max_concurrent", "max_queue",
            "max_model_len", "request_timeout", "graceful_timeout", "metrics_public", "max_body_bytes", "device",
            "dtype", "template", "kt_optimize_rule", "cpu_infer", "chunk_size", "kt_method", "kt_strict_placement",
            "kt_weight_cache", "kv_cache_tokens", "reasoning_parser", "cors_origins", "log_format", "log_level",
            "read_timeout", "prefix_cache", "attention_backend"]
    out = {k: getattr(args, k) for k in keys}
    if args.adapter:
        out["adapters"] = dict(args.adapter)
    if args.adapter_root:
        out["adapter_roots"] = args.adapter_root
    return out


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engines.registry import create_engine
    from server.app import create_app
    from server.http_protocol import http_protocol
    from server.logs import configure_logging
    from server.settings import SettingsError, load_settings
    from server.shutdown import FLUSH_SECONDS, DrainingServer

    try:
        settings = load_settings(args.config, _cli_overrides(args))
    except SettingsError as exc:
        print(f"ktserve: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level)
    if settings.model:
        model_path = settings.model
    else:
        from engines.demo_model import ensure_demo_model
        model_path = str(ensure_demo_model())
        settings.served_model_name = settings.served_model_name or DEMO_MODEL_NAME
        log.info("no model given: serving the built-in demo model from %s", model_path)
    try:
        engine = create_engine(settings.engine, settings.engine_config(model_path))
    except ValueError as exc:
        print(f"ktserve: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings, engine)
    # The drain has already waited for the requests; uvicorn's own wait only has idle connections to close.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None,
                            http=http_protocol(settings.read_timeout),
                            timeout_keep_alive=5, timeout_graceful_shutdown=int(FLUSH_SECONDS))
    server = DrainingServer(config, app.state.drain)
    app.state.on_load_failure = lambda: setattr(server, "should_exit", True)
    server.run()
    return 1 if app.state.load_error else 0


def make_demo_model(args: argparse.Namespace) -> int:
    from engines.demo_model import make_demo_model as make

    path = make(args.dir, seed=args.seed)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ktserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    demo = sub.add_parser("make-demo-model", help="write the tiny random-weight DeepSeek-V3 demo model")
    demo.add_argument("dir")
    demo.add_argument("--seed", type=int, default=0)
    try:
        from evaluation.cli import add_arguments as add_eval_arguments
    except ImportError:
        add_eval_arguments = None
    if add_eval_arguments is not None:
        add_eval_arguments(sub.add_parser("eval", help="evaluate a model through an OpenAI-compatible API"))
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "make-demo-model":
        return make_demo_model(args)
    from evaluation.cli import run as run_eval
    return run_eval(args)


if __name__ == "__main__":
    sys.exit(main())
