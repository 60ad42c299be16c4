"""DeepSeek-V4 with attention, compressors, indexer, hyper-connections and routers on the GPU (the default
DeepSeek-V4-Flash.yaml rule file) and the MXFP4 routed experts in kt-kernel on the CPU: the tiny V4 in the
released layout against transformers' float32 reference (run on a GPU machine: pytest -m gpu).

With kt_use_cuda_graph (the default) the row-wise work of a step is replayed from CUDA graphs, each sequence's
cached attention runs eagerly between them (engines/kt/families/deepseek_v4/graphs.py): greedy replies are the
eager engine's, and concurrent ones their solo runs'."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import start_server
from tests.helpers import GPU_MEDIAN_LOGPROB_DIFF
from .v4_helpers import reference_logprobs, v4_reference_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# bf16 for the non-expert model (float32 on the CPU path). The same model in bf16 on the CPU, 40 positions
# (a 30-token chunk, then decode steps) against the float32 reference: median |dlogprob| 0.038, max 0.23, top-1
# agreement 92.5%; hence the V3 demo model's median bound and a lower top-1 bound for 16 greedy tokens.
V4_MIN_TOP1_AGREEMENT = 0.85
TEXT = ("The history of the river begins in the mountains, where snow melts each spring and feeds a hundred "
        "small streams. They join in the valley, turn the old mills and slow down in the plain. ") * 3


# every routed expert in kt-kernel, prompts' and decode steps' alike (by default the GPU takes a share of them)
KT_KERNEL_ALONE = {"kt_gpu_prefill_tokens": 0, "kt_gpu_read_experts": 0, "kt_decode_kernel": "off"}


@pytest.fixture(scope="module")
def v4_gpu(v4_model_dir):
    """The tiny V4 with every routed expert in kt-kernel (KT_KERNEL_ALONE), the reference the GPU's expert paths
    below are held to."""
    running = start_server(v4_model_dir, engine="ktransformers", **KT_KERNEL_ALONE)
    yield running
    running.stop()


def test_v4_places_everything_but_the_experts_on_the_gpu(v4_gpu):
    assert v4_gpu.engine.info.details["kt_optimize_rule"] == "DeepSeek-V4-Flash.yaml"
    model = v4_gpu.engine._runner.model
    assert model.model.layers[1].self_attn.q_a_proj.weight.is_cuda
    assert v4_gpu.engine.info.details["experts_method"] == "MXFP4"


def test_v4_hyper_connections_on_the_gpu_run_the_fused_kernel(v4_gpu):
    from engines.kt.families.deepseek_v4.hyper import is_fused

    model = v4_gpu.engine._runner.model
    assert v4_gpu.engine.info.details["hyper_connections"].startswith("fused Triton kernel: "), \
        v4_gpu.engine.info.details["hyper_connections"]
    assert all(is_fused(m) for layer in model.model.layers for m in (layer.attn_hc, layer.ffn_hc))
    assert is_fused(model.model.hc_head)


def test_v4_weighted_rms_norms_on_the_gpu_run_fused_in_float32(v4_gpu):
    from engines.kt.placement.operators import FusedRMSNorm

    norms = [m for m in v4_gpu.engine._runner.model.modules()
             if type(m).__name__.endswith("RMSNorm") and getattr(m, "weight", None) is not None]
    assert norms and all(isinstance(m, FusedRMSNorm) and m.upcast and m.weight.is_cuda for m in norms)
    assert " on the GPU fused (torch rms_norm, float32 scale)" in v4_gpu.engine.info.details["rms_norms"]


def test_v4_prompt_logprobs_on_the_gpu_agree_with_the_reference(v4_gpu, v4_model_dir):
    ids = v4_gpu.engine.tokenizer.encode(TEXT)
    reply = v4_gpu.openai().completions.create(model=v4_gpu.engine.info.id, prompt=ids, max_tokens=0, echo=True,
                                               logprobs=1, temperature=0)
    served = torch.tensor(reply.choices[0].logprobs.token_logprobs[1:])
    reference = reference_logprobs(v4_reference_model(v4_model_dir), ids)
    expected = reference[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    diffs = (served - expected).abs()
    print(f"\nV4 on the GPU: median |dlogprob| {diffs.median():.4f}, max {diffs.max():.4f} over {len(diffs)} positions")
    assert diffs.median() < GPU_MEDIAN_LOGPROB_DIFF


def test_v4_greedy_decode_on_the_gpu_agrees_with_the_reference(v4_gpu, v4_model_dir):
    ids = v4_gpu.engine.tokenizer.encode(TEXT)
    reply = v4_gpu.openai().completions.create(model=v4_gpu.engine.info.id, prompt=ids, max_tokens=16,
                                               temperature=0)
    generated = v4_gpu.engine.tokenizer.encode(reply.choices[0].text, add_special_tokens=False)
    full = ids + generated
    reference = reference_logprobs(v4_reference_model(v4_model_dir), full)
    agree = (reference[len(ids) - 1:len(full) - 1].argmax(-1) == torch.tensor(generated)).float().mean()
    assert agree >= V4_MIN_TOP1_AGREEMENT


PROMPTS = [TEXT, "Tell me about rivers.", "1, 2, 3, 4, 5, 6, 7,"]


def test_v4_steps_are_captured_in_piecewise_cuda_graphs(v4_gpu):
    details = v4_gpu.engine.info.details["cuda_graphs"]
    assert details.startswith("piecewise: rows 1,2,4,8,16;"), details
    graphs = v4_gpu.engine._runner.graphs
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 16]
    assert all(len(g) == v4_gpu.engine._runner.config.num_hidden_layers + 1 for g in graphs.graphs.values())


def test_v4_short_decode_steps_are_captured_whole_at_load_for_every_row_bucket(v4_gpu):
    graphs = v4_gpu.engine._runner.graphs
    one_page = {rows for rows, pages in graphs.whole if all(n == 1 for _, n in pages)}
    assert one_page == set(graphs.buckets)


def test_v4_one_sequences_decode_steps_are_captured_whole_at_load_at_every_page_width_it_meets(v4_gpu):
    from engines.kt.families.deepseek_v4.graphs import WHOLE_GRAPHS
    from tests.helpers import completions_together

    graphs, paged = v4_gpu.engine._runner.graphs, v4_gpu.engine._runner.paged
    wider = paged.widths_up_to(min(graphs.longest, paged.sized_for[1]))[1:]
    assert wider  # the tiny V4's context reaches past one page per rate
    assert all((1, tuple(sorted(w.items()))) in graphs.whole for w in wider[:WHOLE_GRAPHS - len(graphs.buckets)])
    captures = graphs.whole_captures
    # decoded past position 256, where its CSA entries take a second page
    completions_together(v4_gpu, [list(range(1000, 1250))], max_tokens=12, ignore_eos=True)
    assert graphs.whole_captures == captures


def test_v4_decode_steps_over_the_paged_caches_replay_whole_step_graphs(v4_gpu):
    from tests.helpers import completions_together

    graphs = v4_gpu.engine._runner.graphs
    whole_steps = graphs.whole_steps
    completions_together(v4_gpu, PROMPTS[1:2], max_tokens=12, ignore_eos=True)
    assert graphs.whole_off is None
    assert graphs.whole_steps - whole_steps == 11  # every decode step after the prompt's (which gave token 1)
    completions_together(v4_gpu, PROMPTS, max_tokens=12, ignore_eos=True)
    assert any(rows == 4 for rows, _ in graphs.whole)  # three decoding together, padded to four rows
    assert "decode steps over the paged caches whole" in v4_gpu.engine.info.details["cuda_graphs"]


def test_v4_decode_steps_made_ahead_while_the_gpu_runs_decode_as_steps_made_at_their_turn(v4_gpu):
    """The next decode step's page tables, made and copied behind the replayed step (graphs.py `_forecast`), give
    the logprobs of the same steps made and copied at their turn, bit for bit."""
    graphs = v4_gpu.engine._runner.graphs
    client = v4_gpu.openai()

    def logprobs() -> list[float]:
        reply = client.completions.create(model=v4_gpu.engine.info.id, prompt=PROMPTS[0], max_tokens=24,
                                          temperature=0, logprobs=1, extra_body={"ignore_eos": True})
        return reply.choices[0].logprobs.token_logprobs

    used = graphs.forecasts_used
    ahead = logprobs()
    assert graphs.forecasts_used - used == 24 - 2  # every decode step but the first (token 2)
    graphs.forecast_off = "compared (test)"
    try:
        at_their_turn = logprobs()
        assert graphs.forecasts_used - used == 24 - 2
    finally:
        graphs.forecast_off = None
    assert ahead == at_their_turn


def test_v4_decodes_the_same_with_cuda_graphs_on_and_off(v4_model_dir, v4_gpu):
    from tests.helpers import completions_together

    graphs = v4_gpu.engine._runner.graphs
    replayed = graphs.replayed
    on = completions_together(v4_gpu, PROMPTS, max_tokens=12, ignore_eos=True)
    assert graphs.replayed > replayed  # decode steps came from the graphs
    off = start_server(v4_model_dir, engine="ktransformers", kt_use_cuda_graph=False, **KT_KERNEL_ALONE)
    try:
        assert off.engine.info.details["cuda_graphs"] == "none: kt_use_cuda_graph is off"
        assert off.engine._runner.graphs is None
        eager = completions_together(off, PROMPTS, max_tokens=12, ignore_eos=True)
    finally:
        off.stop()
    assert on == eager


def test_v4_prompts_decoded_together_from_cuda_graphs_match_their_solo_runs(v4_gpu):
    from tests.helpers import completions_together

    alone = [completions_together(v4_gpu, [p], max_tokens=12, ignore_eos=True)[0] for p in PROMPTS]
    together = completions_together(v4_gpu, PROMPTS, max_tokens=12, ignore_eos=True)
    assert together == alone


def test_v4_prompts_batched_on_the_gpu_agree_with_their_solo_runs(v4_gpu):
    """Concurrent requests share steps (batch.py): each one's prompt logprobs stay within bf16 noise of its run
    alone (the rows of a bf16 GEMM round differently for another number of rows)."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [v4_gpu.engine.tokenizer.encode(TEXT[i * 7:]) for i in range(3)]

    def logprobs(ids):
        reply = v4_gpu.openai().completions.create(model=v4_gpu.engine.info.id, prompt=ids, max_tokens=0, echo=True,
                                                   logprobs=1, temperature=0)
        return torch.tensor(reply.choices[0].logprobs.token_logprobs[1:])

    solo = [logprobs(ids) for ids in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(logprobs, prompts))
    diffs = torch.cat([(a - b).abs() for a, b in zip(together, solo)])
    print(f"\nV4 on the GPU, batched vs alone: median |dlogprob| {diffs.median():.4f}, max {diffs.max():.4f}")
    assert diffs.median() < GPU_MEDIAN_LOGPROB_DIFF


def test_v4_drafting_on_the_gpu_gives_the_replies_without_it(v4_gpu, tmp_path_factory):
    """`speculative: mtp` with the MTP layer a copy of the last layer (its main weights are the plain demo's):
    greedy replies equal the non-drafting server's, alone and three at once (the draft and check rows share the
    batched step; rejected drafts go back through the sequence cache's mark)."""
    from engines.kt.families.deepseek_v4.demo_model import make_demo_model_v4
    from engines.kt.families.deepseek_v4.hyper import is_fused
    from tests.helpers import completions_together

    model = make_demo_model_v4(tmp_path_factory.mktemp("v4-gpu-mtp") / "tiny-v4-mtp", mtp="last-layer")
    drafting = start_server(model, engine="ktransformers", speculative="mtp", speculative_adaptive=False,
                            **KT_KERNEL_ALONE)
    try:
        prompts = PROMPTS
        ask = dict(max_tokens=12, temperature=0, extra_body={"ignore_eos": True})

        def reply(server, prompt):
            return server.openai().completions.create(model=server.engine.info.id, prompt=prompt,
                                                      **ask).choices[0].text

        plain = [reply(v4_gpu, p) for p in prompts]
        alone = [reply(drafting, p) for p in prompts]
        together = completions_together(drafting, prompts, max_tokens=12, ignore_eos=True)
        stats = drafting.engine.stats()
        block = drafting.engine._runner.head.block
    finally:
        drafting.stop()
    print(f"\nV4 drafting on the GPU: {stats.accepted_draft_tokens} of {stats.draft_tokens} drafts accepted")
    assert all(is_fused(m) for m in (block.attn_hc, block.ffn_hc, block.hc_head))  # the MTP block's too
    assert alone == plain
    assert together == plain


def prompt_logprobs(server, ids: list[int]) -> torch.Tensor:
    reply = server.openai().completions.create(model=server.engine.info.id, prompt=ids, max_tokens=0, echo=True,
                                               logprobs=1, temperature=0)
    return torch.tensor(reply.choices[0].logprobs.token_logprobs[1:])


def test_v4_served_at_defaults_decodes_on_the_kernel_and_streams_long_prompts_in_8192_token_chunks(v4_model_dir,
                                                                                                      v4_gpu):
    """With nothing set, a GPU placement whose host holds the MXFP4 copies sends calls under 128 rows (decode steps,
    a short prompt) to the decode kernel with the GPU reading none of their experts, and streams prompt chunks of
    128 tokens or more (kt_gpu_prefill_tokens' default) in chunks of 8,192; both keep kt-kernel's logprobs as the
    GPU's paths do, and decode keeps kt-kernel's greedy tokens."""
    from engines.kt.experts import decode_kernel
    from engines.kt.experts.cpu import RoutedExpertsCPU

    running = start_server(v4_model_dir, engine="ktransformers")
    try:
        details = running.engine.info.details
        assert details["gpu_prefill_tokens"] == "128"
        assert running.engine.config.chunk_size == 8192
        assert details["gpu_read_experts"] == "0"
        assert details["decode_kernel"].startswith(f"ktserve {decode_kernel.isa()} for calls <= 128 rows (MXFP4)")
        assert_greedy_of_kt_kernel_alone(running, v4_gpu, "at defaults, decode on the kernel")
        short = v4_gpu.engine.tokenizer.encode(TEXT)
        diffs = (prompt_logprobs(running, short) - prompt_logprobs(v4_gpu, short)).abs()
        print(f"\nV4 at defaults, a {len(short)}-token prompt on the decode kernel: |dlogprob| against kt-kernel "
              f"alone median {diffs.median():.4f} max {diffs.max():.4f}")
        assert len(short) < 128 and diffs.median() < GPU_MEDIAN_LOGPROB_DIFF
        streamer = next(m.streamer for m in running.engine._runner.model.modules()
                        if isinstance(m, RoutedExpertsCPU) and m.streamer is not None)
        ids = v4_gpu.engine.tokenizer.encode(TEXT * 2)
        before = streamer.stats.chunks
        diffs = (prompt_logprobs(running, ids) - prompt_logprobs(v4_gpu, ids)).abs()
        print(f"\nV4 at defaults, a {len(ids)}-token prompt: {streamer.stats.chunks - before} layer calls streamed; "
              f"|dlogprob| against kt-kernel alone median {diffs.median():.4f} max {diffs.max():.4f}")
        assert len(ids) >= 128 and streamer.stats.chunks > before
        assert diffs.median() < GPU_MEDIAN_LOGPROB_DIFF
    finally:
        running.stop()


def test_v4_with_the_decode_kernel_off_decode_steps_read_the_measured_balance_of_the_mxfp4_copies(v4_model_dir,
                                                                                                  v4_gpu):
    """kt_decode_kernel=off on a GPU placement that streams prompts: decode steps compute 5 of each layer's 8
    experts on the GPU from the MXFP4 copies (the balance of the two readers' measured rates), kt-kernel the rest,
    and keep kt-kernel's greedy tokens."""
    running = start_server(v4_model_dir, engine="ktransformers", kt_decode_kernel="off")
    try:
        assert running.engine.info.details["gpu_read_experts"] == "5"
        assert not running.engine.info.details.get("decode_kernel", "").startswith("ktserve")
        assert_greedy_of_kt_kernel_alone(running, v4_gpu, "decode kernel off, decode reading 5 of 8 MXFP4 copies")
    finally:
        running.stop()


@pytest.fixture(scope="module")
def v4_streaming(v4_model_dir):
    """The tiny V4 with prompt chunks of 16 tokens or more streaming their MXFP4 experts to the GPU, and decode steps
    computing 4 of each layer's 8 experts on the GPU from the same copies (kt_gpu_read_experts: MXFP4 copies are
    read in decode steps only where asked)."""
    running = start_server(v4_model_dir, engine="ktransformers", kt_gpu_prefill_tokens=16, kt_gpu_read_experts=4)
    yield running
    running.stop()


def test_v4_prompts_streaming_their_mxfp4_experts_keep_the_logprobs_of_kt_kernel_alone(v4_gpu, v4_streaming,
                                                                                       v4_model_dir):
    """kt_gpu_prefill_tokens: each layer's experts of a prompt chunk are split between the GPU (the released MXFP4
    bytes copied from pinned host memory, dequantized there) and kt-kernel; the prompt logprobs stay those of the
    server that computes every expert in kt-kernel, and of the float32 reference."""
    import httpx

    from engines.kt.experts.cpu import RoutedExpertsCPU

    details = v4_streaming.engine.info.details
    assert details["gpu_prefill_tokens"] == "16"
    assert "mxfp4 copies" in details["gpu_prefill_copies"], details["gpu_prefill_copies"]
    layers = [m for m in v4_streaming.engine._runner.model.modules()
              if isinstance(m, RoutedExpertsCPU) and m.streamer is not None]
    assert layers and all(m.streamer.layers[m.layer_idx].form == "mxfp4" for m in layers)
    streamer = layers[0].streamer
    before = streamer.stats.chunks
    ids = v4_gpu.engine.tokenizer.encode(TEXT)
    streamed, plain = prompt_logprobs(v4_streaming, ids), prompt_logprobs(v4_gpu, ids)
    reference = reference_logprobs(v4_reference_model(v4_model_dir), ids)
    expected = reference[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    against_plain, against_reference = (streamed - plain).abs(), (streamed - expected).abs()
    print(f"\nV4 streamed experts: {streamer.stats.chunks - before} layer calls streamed "
          f"({streamer.stats.experts} experts, {streamer.stats.bytes / 1e6:.1f} MB); |dlogprob| against kt-kernel "
          f"alone median {against_plain.median():.4f} max {against_plain.max():.4f}, against the reference median "
          f"{against_reference.median():.4f} over {len(ids) - 1} positions")
    assert streamer.stats.chunks - before == len(layers)  # one prompt chunk: every layer streamed once
    text = httpx.get(v4_streaming.url + "/metrics", timeout=10).text
    metrics = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("ktserve_streamed_expert"))
    assert float(metrics["ktserve_streamed_expert_calls_total"]) == streamer.stats.chunks
    assert against_plain.median() < GPU_MEDIAN_LOGPROB_DIFF
    assert against_reference.median() < GPU_MEDIAN_LOGPROB_DIFF


@pytest.mark.parametrize("pcie_bytes_per_s", [float("inf"), 4e7], ids=["free-copies", "slow-copies"])
def test_a_v4_layer_streaming_its_mxfp4_experts_takes_every_one_to_the_gpu_and_equals_kt_kernel_alone(
        pcie_bytes_per_s):
    """The layer-level path on the device: the copies pinned in place, the ring filled on the copy stream, each
    expert dequantized on the GPU, against the same layer all in kt-kernel
    (tests/engines/kt/families/deepseek_v4/test_v4_streamed_experts.py's layer: 20 experts, groups of 8). MXFP4
    calls hand the GPU every expert whatever the copy rate (streaming.ALL_ON_GPU_METHODS: kt-kernel's MXFP4 share
    of a split call finished long after the GPU's); the split itself is checked with BF16 layers
    (tests/engines/kt/experts/test_kt_gpu_streamed_experts.py)."""
    from engines.kt.experts.streaming import ExpertStreamer
    from .test_v4_streamed_experts import E, RELATIVE_TOLERANCE, mxfp4_layer, relative, released_layer, routing

    packed, _ = released_layer()
    alone = mxfp4_layer()
    alone.load_packed(packed)
    streamer = ExpertStreamer(torch.device("cuda"))
    layer = mxfp4_layer(streamer, held=E)
    layer.load_packed(packed)
    assert streamer.layers[3].pinned and streamer.pcie_bytes_per_s > 0  # cudaHostRegister succeeded
    # at 40 MB/s copying the layer takes about as long as kt-kernel's MXFP4 rate for 40 x 4 token-experts (27 ms):
    # a balanced split would keep some in kt-kernel
    streamer.pcie_bytes_per_s = pcie_bytes_per_s
    hidden, ids, weights = routing()
    assert layer._streamed_experts(40) == E
    expected = alone(hidden, ids, weights).float()
    out = layer(hidden.cuda(), ids.cuda(), weights.cuda()).float().cpu()
    assert streamer.stats.experts == E
    assert relative(out, expected) < RELATIVE_TOLERANCE


@pytest.mark.parametrize("tokens", [1, 4])
def test_a_v4_decode_call_reading_part_of_its_mxfp4_copies_on_the_gpu_equals_kt_kernel_alone(tokens):
    """Decode calls (fewer tokens than stream) compute the first experts with the mapped kernels, reading the
    pinned MXFP4 copies through PCIe with V4's clamp, and the rest in kt-kernel: the sum is kt-kernel's alone, and
    the kernels' part is the float32 reference's over those experts."""
    from engines.kt.experts.streaming import ExpertStreamer
    from .test_v4_streamed_experts import (E, RELATIVE_TOLERANCE, mxfp4_layer, reference, relative, released_layer,
                                          routing)

    packed, dense = released_layer()
    alone = mxfp4_layer()
    alone.load_packed(packed)
    streamer = ExpertStreamer(torch.device("cuda"))
    layer = mxfp4_layer(streamer, held=E, read_experts=E // 2)  # MXFP4 copies are read only where asked
    layer.load_packed(packed)
    assert streamer.mapped is not None and 3 in streamer.mapped.layers  # Triton: the kernels read the copies
    share = layer.mapped_experts(tokens)
    assert 0 < share < E
    hidden, ids, weights = (t[:tokens] for t in routing())
    gpu_part = streamer.mapped.compute(3, hidden.cuda(), ids.cuda(), weights.cuda(), share).cpu()
    assert relative(gpu_part, reference(dense, hidden, ids, weights, share)) < RELATIVE_TOLERANCE
    expected = alone(hidden, ids, weights).float()
    out = layer(hidden.cuda(), ids.cuda(), weights.cuda()).float().cpu()
    assert streamer.stats.chunks == 0  # nothing streamed: the kernels and kt-kernel split the call
    assert relative(out, expected) < RELATIVE_TOLERANCE


@pytest.mark.parametrize("tokens", [16, 32, 33, 64, 128])
@pytest.mark.parametrize("resident", [0, 3], ids=["in-host-memory", "some-in-gpu-memory"])
def test_the_mxfp4_kernels_compute_calls_of_every_size_they_take_as_the_float32_reference(tokens, resident):
    """Calls of up to MAX_TOKENS tokens (a prompt's tail: experts/mapped.py), the MXFP4 form, clamped as V4's
    experts are: blocks of 64 tokens once read out of range and summed wrongly."""
    from engines.kt.experts.mapped import MappedExperts
    from engines.kt.experts.host_copies import HostExperts
    from .test_v4_streamed_experts import (E, LIMIT, RELATIVE_TOLERANCE, TOP_K, reference, relative, released_layer,
                                          routing)

    packed, dense = released_layer()
    mapped = MappedExperts(torch.device("cuda"))
    first = {name: tensor[:resident] for name, tensor in packed.items()}
    mapped.register(3, HostExperts.mxfp4_of({name: tensor[resident:] for name, tensor in packed.items()}, pin=True),
                    top_k=TOP_K, resident=HostExperts.mxfp4_of(first).to("cuda") if resident else None, limit=LIMIT)
    hidden, ids, weights = routing(tokens)
    out = mapped.compute(3, hidden.cuda(), ids.cuda(), weights.cuda(), E).cpu()
    assert relative(out, reference(dense, hidden, ids, weights)) < RELATIVE_TOLERANCE


def test_v4_decode_steps_reading_the_streamed_mxfp4_copies_keep_the_greedy_tokens_of_kt_kernel_alone(v4_gpu,
                                                                                                     v4_streaming):
    """kt_gpu_prefill_tokens: decode steps (CUDA graphs) compute a share of each layer's experts on the GPU from
    the MXFP4 copies (kt_gpu_read_experts=4); the greedy reply is the plain server's, or parts where the
    plain server's top two were within the tolerance of the streamed prompts' logprobs (a near tie rounded the
    other way)."""
    from engines.kt.experts.cpu import RoutedExpertsCPU

    layers = [m for m in v4_streaming.engine._runner.model.modules()
              if isinstance(m, RoutedExpertsCPU) and m.streamer is not None]
    assert int(v4_streaming.engine.info.details["gpu_read_experts"]) > 0
    assert layers and all(0 < m.mapped_experts(1) < m.num_experts for m in layers)
    assert_greedy_of_kt_kernel_alone(v4_streaming, v4_gpu, "decode reading the MXFP4 copies")


def assert_greedy_of_kt_kernel_alone(server, plain_server, what: str) -> None:
    """`server`'s greedy reply (CUDA graphs) is `plain_server`'s, every expert in kt-kernel, or parts where the
    plain server's top two were within the tolerance of MXFP4 products rounded another way (a near tie)."""
    from .test_v4_streamed_experts import V4_STREAMED_LOGPROB_TOLERANCE

    ids = plain_server.engine.tokenizer.encode(TEXT)

    def greedy(running):
        reply = running.openai().completions.create(model=running.engine.info.id, prompt=ids, max_tokens=16,
                                                    temperature=0, logprobs=2)
        return reply.choices[0].logprobs

    got, plain = greedy(server), greedy(plain_server)
    same = next((i for i, (a, b) in enumerate(zip(got.tokens, plain.tokens)) if a != b), len(plain.tokens))
    diffs = torch.tensor([abs(a - b) for a, b in zip(got.token_logprobs[:same], plain.token_logprobs[:same])])
    print(f"\nV4 {what}: {same} of {len(plain.tokens)} greedy tokens as kt-kernel alone, |dlogprob| median "
          f"{diffs.median():.4f} max {diffs.max():.4f}")
    assert same >= 1 and diffs.median() < GPU_MEDIAN_LOGPROB_DIFF
    if same < len(plain.tokens):
        top = sorted(plain.top_logprobs[same].values(), reverse=True)
        assert top[0] - top[1] < V4_STREAMED_LOGPROB_TOLERANCE, (same, got.tokens, plain.tokens)


def test_v4_without_streamed_prompts_the_gpu_owns_the_measured_balance_of_experts_by_default(v4_gpu, v4_model_dir):
    """kt_gpu_prefill_tokens=0 and nothing else set: the GPU owns each layer's first 5 of 8 experts (the balance of
    the two MXFP4 readers' measured rates) as the released bytes in pinned host memory, kt-kernel the other 3, and
    the greedy reply is kt-kernel's alone."""
    from engines.kt.experts.cpu import RoutedExpertsCPU

    running = start_server(v4_model_dir, engine="ktransformers", kt_gpu_prefill_tokens=0)
    try:
        details = running.engine.info.details
        layers = [m for m in running.engine._runner.model.modules() if isinstance(m, RoutedExpertsCPU)]
        assert (details["gpu_read_experts"], details["gpu_resident_experts"]) == ("5", "0")
        assert layers and all((m.owned, m.kernel_experts) == (5, 3) for m in layers)
        assert_greedy_of_kt_kernel_alone(running, v4_gpu, "experts the GPU owns by default (5 of 8)")
    finally:
        running.stop()


def test_v4_experts_the_gpu_owns_in_its_memory_and_host_memory_keep_the_greedy_tokens_of_kt_kernel_alone(
        v4_gpu, v4_model_dir):
    """kt_gpu_resident_experts=2 and kt_gpu_read_experts=2 without streaming: each layer's experts 0-1 lie in GPU
    memory and the next two in pinned host memory as the released MXFP4 bytes, computed on the GPU in every step;
    kt-kernel holds only the other 4."""
    from engines.kt.experts.cpu import RoutedExpertsCPU

    running = start_server(v4_model_dir, engine="ktransformers", kt_gpu_read_experts=2, kt_gpu_resident_experts=2)
    try:
        details = running.engine.info.details
        layers = [m for m in running.engine._runner.model.modules() if isinstance(m, RoutedExpertsCPU)]
        assert (details["gpu_read_experts"], details["gpu_resident_experts"]) == ("4", "2")
        assert layers and all((m.owned, m.kernel_experts, m.streamer.resident_experts(m.layer_idx))
                              == (4, m.num_experts - 4, 2) for m in layers)
        assert details["cuda_graphs"].startswith("piecewise"), details["cuda_graphs"]
        assert_greedy_of_kt_kernel_alone(running, v4_gpu, "experts the GPU owns (2 resident, 2 in host memory)")
    finally:
        running.stop()
