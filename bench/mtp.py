"""The `mtp` phase of bench.run: batch-1 decode with and without speculative decoding (`speculative: mtp`).

The benchmark checkpoint has no multi-token-prediction layer, so the phase writes one beside it, twice, each in
a folder of its own that links the checkpoint's shards and adds one shard for the layer (`mtp_variant`):

    random      a random MTP layer, as a V3 checkpoint's would be shaped: its drafts are nearly always rejected,
                so this is what drafting costs when it does not help
    last-layer  the model's last decoder layer copied, and eh_proj passing the next token's embedding through
                (engines/demo_model.py: mtp_layer_tensors): the mechanism with drafts the model accepts more
                often; with random weights that is still far from a trained MTP layer's 80-90%, so the figure
                to compare is the acceptance rate beside the speed

Each runs in its own KT engine (the primary method), decoding one greedy request after the same prompt as the
decode phase, and reports tok/s, the acceptance rate, the time per step and the speed that step time would give
at a trained MTP layer's acceptance (TRAINED_ACCEPTANCE); `off` is the same engine without drafting. Those two
runs draft in every step (`speculative_adaptive` off), so they measure what drafting costs; a third,
`random-adaptive`, decodes ADAPTIVE_TOKENS_FACTOR times as many tokens over the random layer as served by default,
the drafting gate free to pause drafting once it costs more than it saves (engines/runtime/draft_gate.py): its
median step is then a plain one, and it says how many steps ran paused. Run alone: python -m bench.run --only mtp
[--no-cuda-graph].

On the V4 shape (`python -m bench.run --shape v4-flash --only mtp [--v4-layers N]`; `--quick`: the tiny demo
V4's dimensions, a CPU check) `measure_v4` does the same with V4's MTP layer in the released layout (`mtp.0.*`,
`v4_variant`): random, or the last layer copied with `e_proj` passing the next token's embedding through."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from bench.lib.report import fig

# the acceptance trained MTP layers are reported to reach; the phase projects each drafting run's speed to it
TRAINED_ACCEPTANCE = 0.9
KINDS = {"random": "a random MTP layer: drafts nearly always rejected (what drafting costs when it does not help)",
         "last-layer": "the model's last layer copied: drafts accepted more often (the mechanism's ceiling here)"}
ADAPTIVE = "random-adaptive"  # the random layer with the drafting gate on (speculative_adaptive, the default)
RUNS = ("off", *KINDS, ADAPTIVE)
# the adaptive run decodes this many times the other runs' tokens: the gate decides after MIN_DRAFTED verified drafts
# and MEASURE plain steps (engines/runtime/draft_gate.py), and the steps after that are what it measures
ADAPTIVE_TOKENS_FACTOR = 4


def _run_settings(kind: str) -> dict:
    """The engine settings of a run of the phase: no drafting, or drafting over the MTP layer of its kind, the
    gate off except in the adaptive run."""
    return {} if kind == "off" else {"speculative": "mtp", "speculative_adaptive": kind == ADAPTIVE}


def _variant(kind: str) -> str:
    """The MTP layer a drafting run reads (the adaptive run: the random one)."""
    return "random" if kind == ADAPTIVE else kind


def mtp_variant(model_dir: Path, config: dict, kind: str) -> Path:
    """`model_dir` with an MTP layer of `kind`: a sibling folder of links to its files, its index and config
    extended by the layer's shard (written once per kind)."""
    from safetensors import safe_open

    from bench.lib.checkpoint import tensor_specs
    from engines.kt.families.deepseek_mla.demo_model import mtp_layer_tensors
    from engines.checkpoints.source import checkpoint_files

    out, index = _linked_copy(model_dir, kind)
    if out is None:
        return model_dir.with_name(f"{model_dir.name}-mtp-{kind}")
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    wanted = {name for name in index["weight_map"] if name.startswith(last)}
    wanted |= {"model.embed_tokens.weight", "lm_head.weight"}
    weights: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            weights.update({name: f.get_tensor(name) for name in f.keys() if name in wanted})
    layer = mtp_layer_tensors(config, weights, copy_last_layer=True)
    if kind == "random":  # drawn afresh at the checkpoint's own scales (bench/lib/checkpoint.py)
        n, hidden = config["num_hidden_layers"], config["hidden_size"]
        gen = torch.Generator().manual_seed(n)
        for name, shape, init, std in tensor_specs({**config, "num_hidden_layers": n + 1}):
            if name.startswith(f"model.layers.{n}.") and init == "normal":
                layer[name] = (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)
        layer[f"model.layers.{n}.eh_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=gen)
                                                    / (2 * hidden) ** 0.5).to(torch.bfloat16)
    # the copies of the embedding and LM head serving never reads (engines/kt/families/deepseek_mla/mtp.py): left out to save disk
    layer = {name: t.contiguous() for name, t in layer.items() if not name.endswith(("embed_tokens.weight",
                                                                                      "shared_head.head.weight"))}
    return _add_shard(out, index, layer, {**config, "num_nextn_predict_layers": 1})


def v4_variant(model_dir: Path, config: dict, kind: str) -> Path:
    """A V4 checkpoint in the released layout (bench/v4_flash.py) with its MTP layer (`mtp.0.*`) of `kind`, as
    `mtp_variant` does for V3: random (experts as random packed MXFP4, as the benchmark's layers), or the last
    layer copied with e_proj passing the next token's embedding through (engines/kt/families/deepseek_v4/demo_model.py:
    copy_last_layer_as_mtp)."""
    from safetensors import safe_open

    from bench.v4_flash import RandomExpertsV4
    from engines.checkpoints.source import checkpoint_files
    from engines.kt.families.deepseek_v4.demo_model import copy_last_layer_as_mtp

    out, index = _linked_copy(model_dir, kind)
    if out is None:
        return model_dir.with_name(f"{model_dir.name}-mtp-{kind}")
    if kind == "random":
        weights = RandomExpertsV4(config, out).weights
        weights.gen.manual_seed(config["num_hidden_layers"])
        weights.mtp("mtp.0")
        layer = weights.out
    else:
        last = f"layers.{config['num_hidden_layers'] - 1}."
        wanted = {n for n in index["weight_map"] if n.startswith(last)} | {"norm.weight", "hc_head_fn",
                                                                          "hc_head_base", "hc_head_scale"}
        read: dict[str, torch.Tensor] = {}
        for path in checkpoint_files(model_dir):
            with safe_open(str(path), framework="pt") as f:
                read.update({name: f.get_tensor(name) for name in f.keys() if name in wanted})
        layer = copy_last_layer_as_mtp(config, read)
    return _add_shard(out, index, layer, config)


def _linked_copy(model_dir: Path, kind: str) -> tuple[Path | None, dict]:
    """A sibling folder of links to `model_dir`'s files and its index (to extend), or None when it was written
    before."""
    out = model_dir.with_name(f"{model_dir.name}-mtp-{kind}")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    if (out / "model.safetensors.index.json").is_file():
        return None, index
    out.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.name not in ("config.json", "model.safetensors.index.json") and not (out / path.name).exists():
            (out / path.name).symlink_to(path.resolve())
    return out, index


def _add_shard(out: Path, index: dict, layer: dict[str, torch.Tensor], config: dict) -> Path:
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in layer.items()}, str(out / "model-mtp.safetensors"),
              metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(layer, "model-mtp.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "model.safetensors.index.json").write_text(json.dumps(index))  # last: marks the folder complete
    return out


def measure(bench, deadline: float) -> dict:
    """The `mtp` phase: off, then each kind; bench is the running bench.run.Bench."""
    from dataclasses import replace

    from bench.lib.engine_runs import EngineRun

    bench.close_engines()
    p, method = bench.plan, bench.primary
    section: dict = {"method": method, "prompt_tokens": p.decode_prompt, "tokens": p.decode_tokens,
                     "cuda_graphs": bench.cuda_graph, "kinds": KINDS}
    for kind in RUNS:
        if time.perf_counter() > deadline:
            section[kind] = {"skipped": "phase deadline reached"}
            continue
        model_dir = (bench.model_dir if kind == "off"
                     else mtp_variant(bench.model_dir, bench.shape.config, _variant(kind)))
        config = bench.kt_config(method, **_run_settings(kind))
        run = EngineRun("ktransformers", replace(config, model_path=str(model_dir)), bench.log_path, label=kind)
        section[kind] = _decode(run, kind, p.decode_prompt, p.decode_tokens, bench.vocab, deadline)
        bench.results["mtp"] = section
        bench.results.save()
    return section


def _decode(run, kind: str, prompt: int, tokens: int, vocab: int, deadline: float) -> dict:
    """One greedy batch-1 decode in the started `run` (bench.lib.engine_runs.EngineRun), which it closes; with the
    draft tokens verified and kept when `kind` drafts."""
    try:
        run.warm_up(vocab)
        before = run.engine.stats()
        entry = run.decode(prompt, tokens * (ADAPTIVE_TOKENS_FACTOR if kind == ADAPTIVE else 1), vocab, deadline,
                           None)
        after = run.engine.stats()
        drafted = after.draft_tokens - before.draft_tokens
        accepted = after.accepted_draft_tokens - before.accepted_draft_tokens
        if kind != "off":
            entry.update(draft_tokens=drafted, accepted_draft_tokens=accepted,
                         acceptance=fig(accepted / drafted if drafted else None, "fraction"))
        if kind == ADAPTIVE:
            entry.update(draft_paused=after.draft_paused,
                         draft_paused_steps=after.draft_paused_steps - before.draft_paused_steps)
        step_ms = ((entry.get("step_breakdown") or {}).get("step") or {}).get("value")
        if kind in KINDS and step_ms:  # drafting every step: a drafted step costs about the same kept or not
            entry["projected_decode_throughput"] = fig(
                (1 + TRAINED_ACCEPTANCE) / (step_ms / 1e3), "tok/s",
                note=f"1 + {TRAINED_ACCEPTANCE} tokens per step at this run's step time: the speed at a "
                     "trained MTP layer's acceptance")
        graphs = run.engine.info.details.get("cuda_graphs")
        return {"load_time": fig(run.load_time, "s"), "cuda_graphs": graphs, "decode": entry}
    finally:
        run.close()


def measure_v4(model_dir: Path, config: dict, threads: int | None, out: Path, deadline: float, prompt: int = 64,
               tokens: int = 32) -> dict:
    """The `mtp` phase on the V4 shape (`python -m bench.run --shape v4-flash --only mtp`): off, then each kind,
    each in a KT engine of its own (the V4 rules: MXFP4 experts in kt-kernel, the rest on the GPU when there is
    one)."""
    from bench.lib.engine_runs import EngineRun
    from engines.base import EngineConfig

    section: dict = {"shape": "v4-flash", "layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
                     "prompt_tokens": prompt, "tokens": tokens, "kinds": KINDS}
    out.mkdir(parents=True, exist_ok=True)
    for kind in RUNS:
        if time.perf_counter() > deadline:
            section[kind] = {"skipped": "phase deadline reached"}
            continue
        path = model_dir if kind == "off" else v4_variant(model_dir, config, _variant(kind))
        settings = ({"cpu_infer": threads} if threads else {}) | _run_settings(kind)
        engine = EngineConfig(model_path=str(path), model_name=f"bench-v4-mtp-{kind}", max_concurrent=1,
                              max_model_len=4096, chunk_size=2048, settings=settings)
        section[kind] = _decode(EngineRun("ktransformers", engine, out / "engines.log", label=kind), kind, prompt,
                                tokens, config["vocab_size"], deadline)
    return section


def summary(data: dict) -> list[str]:
    """One line per run of the phase, for bench.lib.report's table."""
    section = data.get("mtp") or {}
    lines = []
    for kind in RUNS:
        d = (section.get(kind) or {}).get("decode") or {}
        if not d:
            continue
        rate = (d.get("decode_throughput") or {}).get("value")
        accepted = (d.get("acceptance") or {}).get("value")
        projected = (d.get("projected_decode_throughput") or {}).get("value")
        line = f"mtp {kind:<15} batch-1 decode {_f(rate)} tok/s"
        if kind != "off":
            line += (f", acceptance {_f(accepted, '.3f')} ({d.get('accepted_draft_tokens')} of {d.get('draft_tokens')} "
                     f"draft tokens); at {TRAINED_ACCEPTANCE} acceptance {_f(projected)} tok/s")
        if kind == ADAPTIVE:
            line += f"; {d.get('draft_paused_steps')} steps paused, paused at the end: {d.get('draft_paused')}"
        lines.append(line)
    return lines


def _f(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)
