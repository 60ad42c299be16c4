"""kt_weight_path: routed experts KTransformers users already converted with kt-kernel (`kt quant`, its
convert_cpu_weights.py) are read as they are instead of quantizing the checkpoint's experts again. The folders
here are written by kt-kernel's own saver (the per-layer `_layer_N/_numa_0/*.kt` layout), and merged into
safetensors under the keys the conversion script writes (`blk.N.ffn_<mat>_exps.E.numa.0.<weight|scale>`)."""
from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import start_server
from tests.helpers import require_kt_kernel

require_kt_kernel()

from engines.kt.families.deepseek_mla import load as mla_load  # noqa: E402
from engines.kt.experts.cpuinfer import load_ext, shared_cpu_infer  # noqa: E402
from engines.kt.experts.cache import ConvertedExperts  # noqa: E402
from engines.kt.experts.methods import unavailable_reason  # noqa: E402
from engines.kt.experts.cpu import RoutedExpertsCPU  # noqa: E402
from engines.kt.loader import read_layer_experts  # noqa: E402

MOE_LAYERS, EXPERTS, SIZE = (1, 2, 3), 16, 256  # the demo model's routed experts
_KT_FILE = re.compile(r"^INT8_(gate|up|down)_(\d+)_\d+Byte_(quant|scale)_\.kt$")


def needs_amx_int8() -> None:
    reason = unavailable_reason("AMXINT8")
    if reason is not None:  # kt-kernel's converted INT8 experts run on its AMXInt8_MOE class only
        pytest.skip(f"kt-kernel's AMXINT8 experts do not run here: {reason}")


def write_converted(model_dir, out, merged: bool):
    """The demo model's experts converted as kt-kernel's conversion does it: each layer quantized and saved by
    kt-kernel itself; merged: then gathered into one safetensors file and the layer folders removed."""
    ext, pool = load_ext(), shared_cpu_infer()
    for layer in MOE_LAYERS:
        gate, up, down = (t.to(torch.bfloat16).contiguous() for t in
                          read_layer_experts(model_dir, f"model.layers.{layer}.mlp.experts", EXPERTS))
        mask = torch.zeros(EXPERTS, dtype=torch.bool)
        config = ext.moe.MOEConfig(EXPERTS, 4, SIZE, SIZE, mask.data_ptr())
        config.layer_idx, config.pool, config.max_len = layer, pool.backend_, 32
        config.gate_proj, config.up_proj, config.down_proj = gate.data_ptr(), up.data_ptr(), down.data_ptr()
        config.path, config.save, config.load = str(out), True, False
        identity = torch.arange(EXPERTS, dtype=torch.int64)
        kernel = ext.moe.AMXInt8_MOE(config)  # kept alive until the task has run
        pool.submit(kernel.load_weights_task(identity.data_ptr()))
        pool.sync()
    if merged:
        tensors = {}
        for layer in MOE_LAYERS:
            for file in (out / f"_layer_{layer}" / "_numa_0").iterdir():
                mat, expert, kind = _KT_FILE.match(file.name).groups()
                dtype = np.int8 if kind == "quant" else np.float32
                key = f"blk.{layer}.ffn_{mat}_exps.{expert}.numa.0.{'weight' if kind == 'quant' else 'scale'}"
                tensors[key] = torch.from_numpy(np.fromfile(file, dtype=dtype))
            shutil.rmtree(out / f"_layer_{layer}")
        save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def merged_dir(demo_model_dir, tmp_path_factory):
    needs_amx_int8()
    return write_converted(demo_model_dir, tmp_path_factory.mktemp("kt-merged"), merged=True)


@pytest.mark.parametrize("merged", [True, False], ids=["merged-safetensors", "layer-folders"])
def test_a_converted_layer_computes_what_quantizing_the_checkpoint_computes(demo_model_dir, tmp_path, merged):
    needs_amx_int8()
    converted = ConvertedExperts.open(write_converted(demo_model_dir, tmp_path, merged), SIZE, SIZE)
    assert (converted.method, converted.layers, converted.merged) == ("AMXINT8", frozenset(MOE_LAYERS), merged)
    kwargs = dict(layer_idx=2, num_experts=EXPERTS, top_k=4, hidden_size=SIZE, intermediate_size=SIZE,
                  method="AMXINT8", threads=1)
    read, quantized = RoutedExpertsCPU(**kwargs), RoutedExpertsCPU(**kwargs)
    assert read.load_converted(converted)
    quantized.load_weights(*read_layer_experts(demo_model_dir, "model.layers.2.mlp.experts", EXPERTS))
    hidden = torch.randn(6, SIZE, generator=torch.Generator().manual_seed(0)).bfloat16()
    ids = torch.randint(0, EXPERTS, (6, 4), generator=torch.Generator().manual_seed(1))
    weights = torch.rand(6, 4, generator=torch.Generator().manual_seed(2))
    assert torch.equal(read.forward(hidden, ids, weights), quantized.forward(hidden, ids, weights))


def test_kt_weight_path_serves_the_converted_experts_and_says_so(demo_model_dir, merged_dir):
    running = start_server(demo_model_dir, engine="ktransformers", kt_weight_path=str(merged_dir))
    try:
        version = running.http().get("/version").json()
        reply = running.openai().completions.create(model=running.engine.info.id, prompt="The river", max_tokens=4,
                                                    temperature=0)
    finally:
        running.stop()
    assert version["checkpoint"]["storage"]["experts"] == "AMXINT8 from kt_weight_path"
    assert version["engine_details"]["experts_method"] == "AMXINT8"
    assert reply.usage.completion_tokens == 4


def test_kt_weight_path_converted_for_two_numa_nodes_is_refused_with_the_fix(tmp_path):
    for node in (0, 1):
        folder = tmp_path / "_layer_1" / f"_numa_{node}"
        folder.mkdir(parents=True)
        (folder / "INT8_gate_0_32768Byte_quant_.kt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"2 NUMA nodes.*--threadpool-count 1"):
        ConvertedExperts.open(tmp_path, SIZE, SIZE)


def test_kt_weight_path_without_converted_experts_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"kt_weight_path: .* holds neither"):
        ConvertedExperts.open(tmp_path, SIZE, SIZE)


def test_kt_weight_path_on_a_build_without_its_method_is_refused_naming_it(tmp_path, monkeypatch):
    folder = tmp_path / "_layer_1" / "_numa_0"
    folder.mkdir(parents=True)
    (folder / "INT8_gate_0_65536Byte_quant_.kt").write_bytes(b"")
    monkeypatch.setattr(mla_load, "unavailable_reason", lambda m: "kt-kernel's avx2 build has none of AMXInt8_MOE")
    options = mla_load.KTOptions(kt_weight_path=str(tmp_path))
    config = type("Config", (), {"hidden_size": SIZE, "moe_intermediate_size": SIZE})
    with pytest.raises(ValueError, match=r"kt_weight_path .* holds AMXINT8 experts, but kt-kernel's avx2 build"):
        mla_load.converted_experts(options, config)
