"""The `ktserve` command: serve, make-demo-model, eval."""
from __future__ import annotations

import argparse
import logging
import sys
import types
import typing
from typing import Any

from pydantic.fields import FieldInfo

from engines.demo_model import DEMO_ARCHS, demo_writer, ensure_demo_model, write_demo_gguf
from server.settings import ENV_VARS, KEY_ALIASES, Settings

log = logging.getLogger("ktserve")

DEMO_MODEL_NAME = "ktserve-demo"


class _Pairs(argparse.Action):
    """NAME=PATH, repeatable, collected into a mapping."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any,
                 option_string: str | None = None) -> None:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentError(self, f"{option_string} expects {self.metavar}, got {value!r}")
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest) or {}), name: path})


def _serve_parser(sub: Any) -> None:
    """Every setting is a flag: `--` and its name with dashes, or the field's own (`--adapter`)."""
    p = sub.add_parser("serve", help="start the OpenAI-compatible server",
                       description="Start the server. With no model it serves the built-in demo model.")
    p.add_argument("config", nargs="?", help="YAML config file (LLaMA-Factory key names accepted)")
    for name, field in Settings.model_fields.items():
        flag = (field.json_schema_extra or {}).get("flag") or "--" + name.replace("_", "-")
        p.add_argument(flag, dest=name, default=None, help=_help(name, field), **_kind(field))


def _kind(field: FieldInfo) -> dict[str, Any]:
    """How argparse reads a setting of this type: bools as --x/--no-x, Literals as choices, lists and mappings
    one flag at a time; anything else as one value (a mapping: JSON text)."""
    extra = field.json_schema_extra or {}
    kind = field.annotation
    if isinstance(kind, types.UnionType):  # `T | None`
        kind = next(t for t in typing.get_args(kind) if t is not type(None))
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(kind) is typing.Literal:
        return {"choices": typing.get_args(kind)}
    if "flag" in extra:
        return {"action": _Pairs if typing.get_origin(kind) is dict else "append", "metavar": extra["metavar"]}
    return {"type": kind} if kind in (int, float) else {}


def _help(name: str, field: FieldInfo) -> str:
    """The field's description, with its default and the other names it goes by."""
    notes = [f"env {var}" for var, key in ENV_VARS.items() if key == name]
    aliases = [alias for alias, key in KEY_ALIASES.items() if key == name]
    notes += [f"LLaMA-Factory: {', '.join(aliases)}"] if aliases else []
    default = field.get_default(call_default_factory=True)
    if isinstance(default, bool):
        notes.append(f"default {'on' if default else 'off'}")
    elif default not in (None, [], {}):
        notes.append(f"default {default}")
    return (field.description or "") + (f" ({'; '.join(notes)})" if notes else "")


def _cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name in Settings.model_fields}


def serve(args: argparse.Namespace) -> int:
    # the server stack (uvicorn, FastAPI, the engine registry) is imported by the command that runs it, so
    # `ktserve make-demo-model` and `ktserve eval` start without it
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
    if args.format == "gguf":
        if args.mtp:
            print("ktserve: --mtp: the GGUF demo model has no multi-token-prediction layer (use --format bf16 or "
                  "fp8)", file=sys.stderr)
            return 2
        if args.arch != "deepseek_v3":
            print(f"ktserve: --format gguf writes the deepseek_v3 demo; {args.arch} is written in its released "
                  "layout", file=sys.stderr)
            return 2
        try:
            files = write_demo_gguf(args.dir, {"experts": args.gguf_type, "attention": args.gguf_other_type,
                                               "other": args.gguf_other_type}, split=args.split, seed=args.seed)
        except ValueError as exc:
            print(f"ktserve: {exc}", file=sys.stderr)
            return 2
        print("\n".join(map(str, files)))
        return 0
    if args.arch != "deepseek_v3" and args.format != "bf16":
        print(f"--format applies to the deepseek_v3 demo; {args.arch} is written in its released layout",
              file=sys.stderr)
        return 2
    if args.arch == "deepseek_v3":
        options = {"fmt": args.format, "mtp": args.mtp}
    else:
        options = {"mtp": args.mtp} if args.mtp else {}
    path = demo_writer(args.arch)(args.dir, seed=args.seed, **options)
    print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ktserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    demo = sub.add_parser("make-demo-model", help="write a tiny random-weight DeepSeek model (V3 by default)")
    demo.add_argument("dir")
    demo.add_argument("--arch", default="deepseek_v3", choices=DEMO_ARCHS,
                      help="deepseek_v3: the demo model; deepseek_v32: V3.2 in its released layout (FP8 blocks with "
                           "weight_scale_inv, the lightning indexer, an MTP layer); deepseek_v4: V4 in its released "
                           "layout (FP8 + MXFP4)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--mtp", choices=("random", "last-layer"),
                      help="add a multi-token-prediction layer (for --speculative mtp): random, or a copy of the last "
                           "layer (drafts accepted more often); bf16 and fp8 only; deepseek_v32 and deepseek_v4 "
                           "always have one, random unless this says last-layer")
    demo.add_argument("--format", choices=("bf16", "fp8", "gguf"), default="bf16",
                      help="bf16: a Hugging Face folder of bf16 safetensors; fp8: as DeepSeek ships its FP8 releases "
                           "(128x128 blocks, weight_scale_inv, an MTP layer); gguf: a llama.cpp deepseek2 GGUF "
                           "(tokenizer and chat template inside)")
    demo.add_argument("--gguf-type", default="Q8_0", help="GGUF: the routed experts' type (Q8_0, Q4_K, Q5_K, Q6_K, "
                                                          "IQ4_XS, BF16, Q4_0, Q5_0, F16, F32; default Q8_0)")
    demo.add_argument("--gguf-other-type", default="Q8_0", help="GGUF: the other weights' type (default Q8_0; "
                                                                "norms and the router stay F32)")
    demo.add_argument("--split", action="store_true", help="GGUF: write two files, -00001-of-00002 and -00002")
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
    from evaluation.cli import run as run_eval  # optional: present when the evaluation extras are installed

    return run_eval(args)


if __name__ == "__main__":
    sys.exit(main())
