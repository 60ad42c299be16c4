"""DeepSeek-V4's caches within a memory budget (engines/kt/families/deepseek_v4/budget.py), on the tiny V4 on the
CPU: the bytes the runner charges a sequence are the bytes its caches hold, a budget of two short sequences
serves more concurrent requests than that by preempting and recomputing without changing a token, a request
longer than the budget reaches is refused naming the context, and /metrics reports the caches' use."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from tests.conftest import start_server
from .v4_helpers import runner_sequence

# kv_cache_tokens among max_concurrent 2: 258 KiB for the tiny V4 (most of a short sequence's share is its heavily
# compressed layer's buffer of up to 127 positions): room for two 40-token prompts, not for two sequences past ~50
BUDGET_POSITIONS = 90
PROMPT_TOKENS = 40
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def budgeted(v4_model_dir):
    running = start_server(v4_model_dir, engine="ktransformers", cpu_infer=1, kv_cache_tokens=BUDGET_POSITIONS,
                           max_model_len=1024, max_concurrent=2)
    yield running
    running.stop()


def prompt(seed: int) -> list[int]:
    return torch.randint(100, 1000, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(seed)).tolist()


def complete(server, ids: list[int], max_tokens: int = MAX_TOKENS) -> str:
    return server.openai().completions.create(model=server.engine.info.id, prompt=ids, max_tokens=max_tokens,
                                              temperature=0).choices[0].text


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(name + " ")))


def cache_tensors(cache) -> list[torch.Tensor]:
    """Every distinct tensor a transformers cache's layers hold (V4's keys are its values: one tensor)."""
    seen: dict[int, torch.Tensor] = {}
    for layer in cache.layers:
        for value in vars(layer).values():
            for t in value.values() if isinstance(value, dict) else [value]:
                if isinstance(t, torch.Tensor):
                    seen[id(t)] = t
    return list(seen.values())


def held_bytes(cache) -> int:
    return sum(t.nbytes for t in cache_tensors(cache))


def storage_bytes(cache) -> int:
    """The memory behind those tensors: each distinct storage once, whole (a view keeps all of it alive)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in cache_tensors(cache)}
    return sum(storages.values())


def test_v4_charged_bytes_equal_the_bytes_its_caches_hold(budgeted):
    from engines.runtime.model_runner import ScheduledChunk

    runner = budgeted.engine._runner
    ids = prompt(0) * 4  # 160 positions: the heavily compressed layer's first entry and a partial window
    seq = runner_sequence(ids)

    def feed() -> list[tuple[int, int, int]]:
        at, seen = 0, []
        for n in [50, 79] + [1] * 6 + [25]:  # prompt chunks across window ends, decode steps, one more chunk
            runner.execute([ScheduledChunk(seq=seq, start=at, end=at + n)])
            at += n
            cache = seq.runner_state.cache
            seen.append((at, held_bytes(cache), storage_bytes(cache), runner.budget.sizes.at(at)))
        runner.release(seq)
        return seen

    sizes = budgeted.engine._runner.budget.sizes
    row = sizes.head_dim * sizes.element  # a sliding window's keys are the last W - 1 of the W a step concatenated
    for positions, held, storage, charged in budgeted.engine.run_on_engine_thread(feed):
        assert charged == held, positions
        assert charged <= storage <= charged + sizes.window_tensors * row, positions  # no prompt chunk kept alive


def test_v4_draft_head_cache_bytes_are_one_sliding_window_layer_more(v4_model_dir):
    from transformers import AutoConfig
    from transformers.cache_utils import DynamicCache

    from engines.kt.families.deepseek_v4.budget import CacheBytes
    from engines.kt.families.deepseek_v4.mtp import draft_config

    config = AutoConfig.from_pretrained(v4_model_dir)
    cache = DynamicCache(config=draft_config(config))  # as the draft head makes one per sequence
    at = 0
    for n in (7, 12, 1):
        keys = torch.randn(1, 1, n, config.head_dim)
        cache.update(keys, keys, 0)  # as the block's attention feeds it
        at += n
        extra = (CacheBytes.of(config, torch.float32, draft_head=True).at(at)
                 - CacheBytes.of(config, torch.float32).at(at))
        assert extra == held_bytes(cache)


def test_v4_concurrent_requests_past_the_budget_are_preempted_and_equal_their_solo_outputs(budgeted):
    prompts = [prompt(seed) for seed in range(1, 4)]
    solo = [complete(budgeted, ids) for ids in prompts]  # one at a time: each fits alone
    before = metric(budgeted, "ktserve_preemptions_total")
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda ids: complete(budgeted, ids), prompts))
    assert together == solo
    assert metric(budgeted, "ktserve_preemptions_total") > before


def test_v4_a_request_longer_than_the_budget_reaches_is_a_400_naming_the_context(budgeted):
    limit = budgeted.engine.info.max_model_len
    assert limit == BUDGET_POSITIONS  # the budget, not max_model_len, decides the context
    with pytest.raises(openai.BadRequestError) as refused:
        complete(budgeted, prompt(5) * 5, max_tokens=4)  # 200 tokens
    assert f"maximum context length is {limit} tokens" in refused.value.message
    assert refused.value.body["param"] == "prompt"


def test_v4_cache_use_is_reported_on_metrics(budgeted):
    assert metric(budgeted, "ktserve_kv_cache_total_tokens") == BUDGET_POSITIONS
    stream = budgeted.openai().completions.create(model=budgeted.engine.info.id, prompt=prompt(6), max_tokens=8,
                                                  temperature=0, stream=True)
    next(iter(stream))  # the request holds its caches while it streams
    used = metric(budgeted, "ktserve_kv_cache_used_tokens")
    for _ in stream:
        pass
    budgeted.wait_idle()
    assert 0 < used <= BUDGET_POSITIONS
    assert metric(budgeted, "ktserve_kv_cache_used_tokens") == 0


def test_v4_model_of_sliding_window_layers_only_reaches_every_position_the_budget_allows(v4_model_dir):
    """Past its window such a model's caches hold the same bytes at any length: the context the budget reaches
    is the positions asked for (the search for it used to double forever)."""
    from transformers import AutoConfig

    from engines.kt.families.deepseek_v4.budget import CacheBytes

    config = AutoConfig.from_pretrained(v4_model_dir)
    config.layer_types = ["sliding_attention"] * len(config.layer_types)
    sizes = CacheBytes.of(config, torch.float32)
    assert sizes.positions_within(sizes.bound(10 * config.sliding_window), 1 << 20) == 1 << 20
    assert sizes.positions_within(sizes.bound(3) - 1, 1 << 20) < 3
