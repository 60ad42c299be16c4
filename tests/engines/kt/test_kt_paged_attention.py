"""The FlashInfer attention path's own part, checked on the CPU: the per-step plans (query and page index
pointers, page lists, lengths), the causal alignment of prefill chunks, and the LoRA on kv_b applied around
the kernel. A plain-torch kernel with the documented semantics of FlashInfer's `BatchMLAPagedAttentionWrapper`
stands in for the CUDA one, which tests/engines/kt/test_kt_gpu_flashinfer.py compares with torch on a GPU."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.conftest import start_server
from tests.helpers import require_kt_kernel
from tests.lora_helpers import make_peft_adapter

require_kt_kernel()



class ReferenceMLAWrapper:
    """FlashInfer's paged MLA wrapper in torch: plan() takes the step's index arrays, run() attends each
    sequence's queries (the last qo_len of its kv_len positions) over its pages."""

    def __init__(self, workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None, kv_indices=None,
                 kv_len_arr=None, backend="auto"):
        self.plans = 0

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type):
        assert qo_indptr.dtype == kv_indptr.dtype == kv_indices.dtype == kv_len_arr.dtype == torch.int32
        self.qo, self.kv, self.indices, self.lens = qo_indptr.tolist(), kv_indptr.tolist(), kv_indices, kv_len_arr
        self.causal, self.scale, self.page = causal, sm_scale, page_size
        self.plans += 1

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache):
        out = torch.empty_like(q_nope)
        for i in range(len(self.qo) - 1):
            rows = slice(self.qo[i], self.qo[i + 1])
            pages = self.indices[self.kv[i]:self.kv[i + 1]].long()
            length = int(self.lens[i])
            ckv = ckv_cache[pages].reshape(-1, ckv_cache.shape[-1])[:length]
            kpe = kpe_cache[pages].reshape(-1, kpe_cache.shape[-1])[:length]
            scores = (torch.einsum("nhr,lr->nhl", q_nope[rows], ckv)
                      + torch.einsum("nhd,ld->nhl", q_pe[rows], kpe)) * self.scale
            n = scores.shape[0]
            if self.causal:
                allowed = torch.arange(length).unsqueeze(0) <= (length - n + torch.arange(n)).unsqueeze(1)
                scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
            out[rows] = torch.einsum("nhl,lr->nhr", torch.softmax(scores.float(), -1).to(ckv.dtype), ckv)
        return out


@pytest.fixture(scope="module")
def runner(demo_model_dir, tmp_path_factory, reference_model):
    """An idle KT engine's runner (the tests drive its attention directly) with an attention adapter."""
    adapter = tmp_path_factory.mktemp("paged-adapter") / "attn"
    make_peft_adapter(reference_model, "attn", adapter)
    running = start_server(demo_model_dir, engine="ktransformers", kt_method="BF16", adapters={"attn": str(adapter)})
    yield running.engine._runner
    running.stop()


@pytest.fixture
def flash(runner, monkeypatch):
    """FlashInfer attention for the runner's model, with the reference kernel installed as FlashInfer."""
    from engines.kt.families.deepseek_mla.flashinfer import FlashInferMLA, MLAShape

    package, mla = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.mla")
    mla.BatchMLAPagedAttentionWrapper = ReferenceMLAWrapper
    package.mla = mla
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.mla", mla)
    attention, cache = runner.layers[1].self_attn, runner.cache
    return FlashInferMLA(MLAShape(attention.num_heads, cache.latent_dim, cache.rope_dim, cache.block_size,
                                  attention.scaling, torch.float32, torch.float32))


@pytest.fixture
def tables(runner):
    """Three sequences' cache pages, room for 200 positions each, released afterwards."""
    from engines.kt.families.deepseek_mla.kv_cache import BlockTable

    made = [BlockTable() for _ in range(3)]
    for table in made:
        assert runner.cache.admit(table, [0] * 200, "", reuse=False) is not None
    yield made
    for table in made:
        runner.cache.release(table)


def attend(runner, flash, pieces, x):
    from engines.lora.modules import AdapterRows

    runner.flash = flash
    try:
        batch = runner.step_batch(pieces)
    finally:
        runner.flash = None
    with torch.no_grad(), runner.lora.context.step(AdapterRows([(s.adapter, s.row, s.n) for s in batch.spans])):
        return runner.layers[1].self_attn(x, batch)


def hidden(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 256, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("adapter", [None, "attn"])
def test_a_mixed_step_attends_through_the_paged_kernel_as_through_torch(runner, flash, tables, adapter):
    a, b, c = tables
    attend(runner, None, [(b, 0, 64, None), (c, 0, 130, None)], hidden(194, 0))  # earlier chunks, in the cache
    pieces = [(a, 0, 40, None), (b, 64, 100, adapter), (c, 130, 131, None)]  # a prompt, a later chunk, a decode
    x = hidden(77, 1)
    expected = attend(runner, None, pieces, x)
    got = attend(runner, flash, pieces, x)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert flash.eager(torch.device("cpu")).wrapper.plans == 1  # once for the step, whatever the layers


def test_a_decode_step_attends_through_the_paged_kernel_as_through_torch(runner, flash, tables):
    from engines.kt.families.deepseek_mla.attention import DecodeBatch

    attend(runner, None, [(t, 0, length, None) for t, length in zip(tables, (5, 70, 150))], hidden(225, 2))
    lengths = [6, 71, 151]
    pages = [t.blocks[:runner.cache.blocks_for(n)] for t, n in zip(tables, lengths)]
    write = torch.tensor([int(runner.cache.slots(t, n - 1, n)[0]) for t, n in zip(tables, lengths)])
    read, mask = runner.cache.context_slots(pages, lengths, 3, max(lengths), runner.scratch_slot)
    step = dict(positions=torch.tensor(lengths) - 1, write_slots=write, read_slots=read, mask=mask,
                cache=runner.cache, rotary=runner.inner.rotary_emb)
    x = hidden(3, 3)
    with torch.no_grad():
        expected = runner.layers[1].self_attn.decode(x, DecodeBatch(**step))
        paged = flash.eager(torch.device("cpu")).plan([1, 1, 1], lengths, pages, causal=False)
        got = runner.layers[1].self_attn.decode(x, DecodeBatch(**step, paged=paged))
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
