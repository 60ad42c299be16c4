"""DeepSeek-V4's prefix cache (engines/kt/families/deepseek_v4/prefixes.py) on the tiny V4 on the CPU: a prompt
that starts with a prefix computed before starts from that prefix's cache state, kept at a 128-position page
boundary, computes only the rest, says how many tokens it reused, and answers as its first run did; a state is
found only for the very tokens and adapter it holds, nothing is kept with prefix caching off, and stored states
stay within the cache budget, dropped least recently used first, while requests keep being served."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.conftest import start_server
from tests.helpers import require_kt_kernel
from .v4_helpers import (V4_LOGPROB_TOLERANCE, V4_NEAR_TIE_TOLERANCE, Choices, diffs_off_and_on_ties, fail_once,
                         flipped_near_ties, load_v4_runner, reference_logprobs, runner_sequence, v4_reference_model)
from .v4_lora_helpers import make_kt_sft_v4_adapter

require_kt_kernel()

PAGE = 128
LENGTH = 300  # prompt tokens: two pages and a tail, so the state at 256 is kept


def ids(seed: int, n: int = LENGTH) -> list[int]:
    return torch.randint(100, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def last_page(prompt_tokens: int) -> int:
    """The positions a repeated prompt finds cached: its pages before its last token."""
    return (prompt_tokens - 1) // PAGE * PAGE


@pytest.fixture(scope="module")
def v4_cold(v4_model_dir):
    running = start_server(v4_model_dir, engine="ktransformers", cpu_infer=1, prefix_cache=False)
    yield running
    running.stop()


def complete(server, prompt, model: str | None = None, max_tokens: int = 6, **kwargs):
    return server.openai().completions.create(model=model or server.engine.info.id, prompt=prompt,
                                              max_tokens=max_tokens, temperature=0, logprobs=0, **kwargs)


def cached(reply) -> int:
    return reply.usage.prompt_tokens_details.cached_tokens


def logprobs(reply) -> list[float]:
    return reply.choices[0].logprobs.token_logprobs


def test_a_repeated_v4_prompt_reuses_its_last_page_and_answers_as_its_first_run(v4_server):
    first = complete(v4_server, ids(1))
    second = complete(v4_server, ids(1))
    assert cached(first) == 0
    assert cached(second) == last_page(LENGTH) == 2 * PAGE
    # the first run computed its tail after the same boundary in a chunk of its own: the same bits
    assert second.choices[0].text == first.choices[0].text
    assert logprobs(second) == logprobs(first)


def test_a_cached_v4_prompt_answers_as_a_server_without_prefix_caching(v4_server, v4_cold):
    complete(v4_server, ids(2))
    warm = complete(v4_server, ids(2))
    cold = complete(v4_cold, ids(2))
    assert cached(warm) > 0 and cached(cold) == 0
    assert warm.choices[0].text == cold.choices[0].text
    assert max(abs(a - b) for a, b in zip(logprobs(warm), logprobs(cold))) < V4_LOGPROB_TOLERANCE


def test_chat_usage_reports_the_cached_tokens_of_a_repeated_v4_conversation(v4_server):
    messages = [{"role": "user", "content": "Read this and answer. " + "The tide came in over the grey stones. " * 30}]

    def chat():
        return v4_server.openai().chat.completions.create(model=v4_server.engine.info.id, messages=messages,
                                                          temperature=0, max_tokens=4)

    first, second = chat(), chat()
    assert cached(second) == last_page(second.usage.prompt_tokens) >= PAGE
    assert second.choices[0].message.content == first.choices[0].message.content


def test_the_next_turn_of_a_v4_chat_starts_from_the_state_the_previous_turn_kept(v4_server):
    messages = [{"role": "user", "content": "Keep this in mind. " + "The lamp on the pier burns until dawn. " * 30}]

    def chat():
        return v4_server.openai().chat.completions.create(model=v4_server.engine.info.id, messages=messages,
                                                          temperature=0, max_tokens=6)

    first = chat()
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    second = chat()
    assert cached(second) == last_page(first.usage.prompt_tokens) >= 2 * PAGE


def test_a_shared_v4_preamble_is_kept_where_two_prompts_part_and_reused_by_the_next(v4_server):
    preamble = ids(3, 2 * PAGE + 40)  # the prompts part after 296 tokens: kept at 256
    complete(v4_server, preamble + ids(30, 100))
    second = complete(v4_server, preamble + ids(31, 110))
    third = complete(v4_server, preamble + ids(32, 90))
    assert cached(second) == 0  # the first kept its own last page, at 384: past the preamble
    assert cached(third) == 2 * PAGE


def test_a_v4_prefix_differing_in_one_token_is_not_reused(v4_server):
    prompt = ids(4)
    complete(v4_server, prompt)
    other = list(prompt)
    other[PAGE - 1] += 1  # the last token of the first page
    assert cached(complete(v4_server, other)) == 0
    assert cached(complete(v4_server, prompt)) == 2 * PAGE  # the original is still there


def test_a_v4_adapter_never_borrows_a_prefix_the_base_model_computed(v4_server, v4_model_dir, v4_adapter_root):
    make_kt_sft_v4_adapter(v4_model_dir, v4_adapter_root / "prefix-a", seed=21)
    with v4_server.http() as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "prefix-a",
                                                          "lora_path": str(v4_adapter_root / "prefix-a")})
    assert loaded.status_code == 200, loaded.text
    try:
        complete(v4_server, ids(5))
        complete(v4_server, ids(5))
        adapted = complete(v4_server, ids(5), model="prefix-a")
        again = complete(v4_server, ids(5), model="prefix-a")
        assert cached(adapted) == 0
        assert cached(again) == 2 * PAGE
        assert again.choices[0].text == adapted.choices[0].text and logprobs(again) == logprobs(adapted)
    finally:
        with v4_server.http() as http:
            http.post("/v1/unload_lora_adapter", json={"lora_name": "prefix-a"})


def test_v4_prompt_logprobs_are_computed_whole_even_when_their_prefix_is_kept(v4_server):
    complete(v4_server, ids(6))
    scored = complete(v4_server, ids(6), max_tokens=0, echo=True)
    values = logprobs(scored)
    assert cached(scored) == 0
    assert len(values) == LENGTH and all(v is not None for v in values[1:])


def test_the_choices_of_one_v4_request_compute_their_shared_prompt_once(v4_server):
    before = v4_server.engine.stats().cached_prompt_tokens
    reply = v4_server.openai().completions.create(model=v4_server.engine.info.id, prompt=ids(7), max_tokens=3, n=3,
                                                  temperature=1.0, seed=5)
    assert len(reply.choices) == 3
    # the second and third choice wait for the first to keep the state at its last page, then start there
    assert v4_server.engine.stats().cached_prompt_tokens - before == 2 * last_page(LENGTH)


def test_a_batch_of_v4_prompts_sharing_a_preamble_computes_it_twice_at_most(v4_server):
    """The first prompt keeps only its own last page; the second, parting from it after the preamble, keeps the
    preamble's last page, and the others wait for it."""
    preamble = ids(10, 2 * PAGE + 40)
    before = v4_server.engine.stats().cached_prompt_tokens
    reply = v4_server.openai().completions.create(model=v4_server.engine.info.id, max_tokens=2, temperature=0,
                                                  prompt=[preamble + ids(100 + i, 100) for i in range(4)])
    assert len(reply.choices) == 4
    assert v4_server.engine.stats().cached_prompt_tokens - before == 2 * (2 * PAGE)


def test_v4_metrics_count_prompt_tokens_and_cached_ones(v4_server):
    def counters() -> tuple[float, float]:
        text = httpx.get(v4_server.url + "/metrics", timeout=10).text
        values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("ktserve_prefix_cache"))
        return (float(values["ktserve_prefix_cache_queried_tokens_total"]),
                float(values["ktserve_prefix_cache_hit_tokens_total"]))

    complete(v4_server, ids(8))
    queried, hits = counters()
    reply = complete(v4_server, ids(8))
    after_queried, after_hits = counters()
    assert after_queried - queried == reply.usage.prompt_tokens
    assert after_hits - hits == cached(reply) > 0


def test_v4_version_details_say_the_prefix_cache_is_on(v4_server):
    assert v4_server.engine.info.details["v4_prefix_cache"].startswith("on: ")


def test_without_prefix_caching_v4_keeps_nothing_and_reports_nothing_cached(v4_cold):
    complete(v4_cold, ids(9))
    assert cached(complete(v4_cold, ids(9))) == 0
    runner = v4_cold.engine._runner
    assert len(runner.prefixes) == 0 and runner.budget.cached == 0
    assert v4_cold.engine.info.details["v4_prefix_cache"] == "off: prefix_cache is off"


def test_v4_stored_prefixes_under_a_small_budget_are_dropped_oldest_first_and_requests_keep_being_served(
        v4_model_dir):
    # room for about two 300-token sequences: every stored state beside them squeezes the next admission
    running = start_server(v4_model_dir, engine="ktransformers", cpu_infer=1, kv_cache_tokens=700,
                           max_model_len=1024, max_concurrent=2)
    try:
        runner = running.engine._runner
        prompts = [ids(40 + i) for i in range(6)]
        first = [complete(running, p).choices[0].text for p in prompts]
        assert len(runner.prefixes) < len(prompts)  # the oldest were dropped for the newer
        assert runner.budget.cached + runner.budget.used <= runner.budget.capacity
        with ThreadPoolExecutor(3) as pool:
            again = list(pool.map(lambda p: complete(running, p).choices[0].text, prompts))
        assert again == first
        latest = complete(running, prompts[-1])
        assert cached(latest) == 2 * PAGE and latest.choices[0].text == first[-1]
        running.wait_idle()
        assert running.engine.stats().kv_used_tokens == 0
    finally:
        running.stop()


def test_v4_requests_started_from_a_kept_state_and_preempted_give_their_solo_output(v4_model_dir):
    # room for two 300-token prompts, not for both past ~360 positions: the newest is preempted as they decode
    running = start_server(v4_model_dir, engine="ktransformers", cpu_infer=1, kv_cache_tokens=500,
                           max_model_len=1024, max_concurrent=2)
    try:
        def text_and_cached(prompt):
            reply = running.openai().completions.create(model=running.engine.info.id, prompt=prompt, max_tokens=70,
                                                        temperature=0)
            return reply.choices[0].text, cached(reply)

        solo, _ = text_and_cached(ids(70))
        before = running.engine.stats().preemptions
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(text_and_cached, [ids(70)] * 3))
        assert running.engine.stats().preemptions > before
        assert together == [(solo, 2 * PAGE)] * 3
    finally:
        running.stop()


def test_stored_v4_prefixes_are_dropped_only_for_a_request_they_make_room_for(v4_model_dir):
    from transformers import AutoConfig

    from engines.kt.families.deepseek_v4.budget import CacheBudget, CacheBytes

    sizes = CacheBytes.of(AutoConfig.from_pretrained(v4_model_dir), torch.float32)
    budget = CacheBudget(sizes, capacity=3 * sizes.at(LENGTH), positions=3 * LENGTH)
    asked: list[int] = []

    def reclaim(nbytes: int) -> None:
        asked.append(nbytes)
        budget.drop_prefix(budget.cached)

    budget.reclaim = reclaim
    assert budget.hold_prefix(sizes.at(LENGTH)) and budget.hold_prefix(sizes.at(LENGTH))
    assert sizes.at(20 * LENGTH) > budget.capacity
    assert not budget.admit("too long", 20 * LENGTH) and asked == []  # it would not fit with both dropped
    assert budget.admit("fits", 2 * LENGTH) and len(asked) == 1
    assert budget.used + budget.cached <= budget.capacity


# ------------------------------------------------------------------------------------------------ the runner
@pytest.fixture(scope="module")
def runner(v4_model_dir):
    return load_v4_runner(v4_model_dir)


def admitted(runner, token_ids: list[int], batch_invariant: bool = False):
    seq = runner_sequence(token_ids, batch_invariant=batch_invariant)
    seq.num_computed = runner.admit(seq)
    seq.prompt_logprobs = None
    return seq


def feed(runner, seq, end: int) -> list[torch.Tensor]:
    """Prompt chunks up to `end`, cut where the runner keeps states (as the scheduler cuts them)."""
    from engines.runtime.model_runner import ScheduledChunk

    out = []
    while seq.num_computed < end:
        stop = runner.prefill_end(seq, end)
        out.append(runner.execute([ScheduledChunk(seq=seq, start=seq.num_computed, end=stop, all_logits=True)])[0])
        seq.num_computed = stop
    return out


def stored_tensors(runner) -> list[torch.Tensor]:
    (state,) = runner.prefixes._states.values()
    return [t for _, layer in state.layers for v in layer.values()
            for t in (v.values() if isinstance(v, dict) else [v]) if isinstance(t, torch.Tensor)]


def test_a_kept_v4_state_is_charged_its_bytes_and_not_changed_by_the_steps_after_it(runner):
    from engines.kt.families.deepseek_v4.caches import snapshot_bytes

    seq = admitted(runner, ids(50))
    feed(runner, seq, 2 * PAGE)
    (state,) = runner.prefixes._states.values()
    assert state.position == 2 * PAGE
    assert runner.budget.cached == state.nbytes == snapshot_bytes(state.layers) > 0
    before = [t.clone() for t in stored_tensors(runner)]
    feed(runner, seq, LENGTH)
    seq.token_ids = seq.token_ids + [5] * 9  # decode steps too
    for _ in range(8):
        feed(runner, seq, seq.num_computed + 1)
    assert all(torch.equal(a, b) for a, b in zip(before, stored_tensors(runner)))
    runner.release(seq)
    runner.prefixes.reclaim(runner.budget.cached)
    assert runner.budget.cached == 0 and runner.budget.used == 0


def test_a_batch_invariant_v4_sequence_started_from_a_kept_state_computes_what_the_one_that_kept_it_did(runner):
    first = admitted(runner, ids(51), batch_invariant=True)
    cold = feed(runner, first, LENGTH)
    second = admitted(runner, ids(51), batch_invariant=True)
    assert second.num_computed == 2 * PAGE
    warm = feed(runner, second, LENGTH)
    assert len(cold) == 2 and len(warm) == 1
    assert torch.equal(warm[0], cold[1])  # its tail, in the same chunk over the same cache
    for seq in (first, second):
        runner.release(seq)
    runner.prefixes.reclaim(runner.budget.cached)


def test_a_failed_step_of_a_v4_sequence_started_from_a_kept_state_runs_again_to_what_a_clean_run_gives(
        runner, monkeypatch):
    """The first step after the borrowed positions fails midway (the first layers' attention already extended the
    cache): the rerun starts from the borrowed state, which the failure left as it was."""
    from engines.runtime.model_runner import ScheduledChunk

    first = admitted(runner, ids(52))
    feed(runner, first, LENGTH)
    before = [t.clone() for t in stored_tensors(runner)]

    def tail(fault: bool) -> torch.Tensor:
        seq = admitted(runner, ids(52))
        chunk = [ScheduledChunk(seq=seq, start=seq.num_computed, end=LENGTH, all_logits=True)]
        if fault:
            with monkeypatch.context() as patch:
                fail_once(runner.model.model.layers[2].mlp.gate, patch)
                with pytest.raises(RuntimeError, match="injected fault"):
                    runner.execute(chunk)
        logits = runner.execute(chunk)[0]
        runner.release(seq)
        return logits

    assert torch.equal(tail(fault=True), tail(fault=False))
    assert all(torch.equal(a, b) for a, b in zip(before, stored_tensors(runner)))
    runner.release(first)
    runner.prefixes.reclaim(runner.budget.cached)



def token_logprobs(logits: torch.Tensor, token_ids: list[int], first: int) -> list[float | None]:
    """The logprob of each token from `first` + 1 on, indexed as a server reports them (NaN before), from logits
    whose row j predicts token first + j + 1."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return [float("nan")] * (first + 1) + [float(lp[j, token_ids[first + j + 1]])
                                           for j in range(len(token_ids) - first - 1)]


def assert_matches_reference(served: list, served_choices, reference_model, token_ids: list[int], first: int) -> None:
    """The tokens after `first` within rounding of the reference, but at few near ties (test_v4_serving's rule)."""
    with Choices(reference_model, gaps=True) as reference_choices:
        reference = reference_logprobs(reference_model, token_ids)
    ties = flipped_near_ties(served_choices, reference_choices)
    off, on = diffs_off_and_on_ties(served, reference, token_ids, ties)
    off, on = [d for d in off if d == d], [d for d in on if d == d]  # NaN: a token before `first` + 1
    assert len(off) + len(on) == len(token_ids) - first - 1
    assert max(off) < V4_LOGPROB_TOLERANCE
    assert max(on, default=0.0) < V4_NEAR_TIE_TOLERANCE and len(on) <= len(token_ids) // 20


def test_a_v4_prompt_keeps_the_state_at_a_cut_inside_its_chunk_within_one_step(runner):
    """Not batch-invariant: the prompt is one chunk, run as two pieces over one cache, the state taken between
    them, rather than a step more for its tail (which reads or copies nearly every expert once more)."""
    one = admitted(runner, ids(53))
    assert runner.prefill_end(one, LENGTH) == LENGTH
    feed(runner, one, LENGTH)
    (state,) = runner.prefixes._states.values()
    assert state.position == 2 * PAGE and runner.budget.cached == state.nbytes
    cut_run = admitted(runner, ids(54), batch_invariant=True)
    assert runner.prefill_end(cut_run, LENGTH) == 2 * PAGE
    feed(runner, cut_run, LENGTH)
    kept = {s.position: s for s in runner.prefixes._states.values()}
    assert [(kind, sorted(v)) for kind, v in kept[2 * PAGE].layers] == [(kind, sorted(v)) for kind, v in state.layers]
    for seq in (one, cut_run):
        runner.release(seq)
    runner.prefixes.reclaim(runner.budget.cached)


def test_the_tail_of_a_v4_chunk_after_a_kept_state_and_a_prompt_borrowing_it_match_the_reference(runner,
                                                                                                   v4_model_dir):
    """The chunk's second piece attends over the cache the first piece left in the same step (its sliding-window
    mask made then); a later prompt starting from the state kept between them computes the rest."""
    reference_model = v4_reference_model(v4_model_dir)
    tokens = ids(55)
    one = admitted(runner, tokens)
    with Choices(runner.model) as choices:
        (logits,) = feed(runner, one, LENGTH)
    assert_matches_reference(token_logprobs(logits, tokens, 0), choices, reference_model, tokens, 0)
    borrower = admitted(runner, tokens + [7, 8, 9])
    assert borrower.num_computed == 2 * PAGE
    with Choices(runner.model, start=2 * PAGE) as choices:
        (warm,) = feed(runner, borrower, LENGTH + 3)
    assert_matches_reference(token_logprobs(warm, tokens + [7, 8, 9], 2 * PAGE), choices, reference_model,
                             tokens + [7, 8, 9], 2 * PAGE)
    for seq in (one, borrower):
        runner.release(seq)
    runner.prefixes.reclaim(runner.budget.cached)


def test_two_v4_prompts_with_the_same_tokens_in_one_step_store_and_charge_one_state(runner):
    from engines.runtime.model_runner import ScheduledChunk

    seqs = [admitted(runner, ids(56)) for _ in range(2)]
    runner.execute([ScheduledChunk(seq=s, start=0, end=LENGTH, all_logits=False) for s in seqs])
    (state,) = runner.prefixes._states.values()
    assert state.position == 2 * PAGE and runner.budget.cached == state.nbytes
    for seq in seqs:
        runner.release(seq)
    runner.prefixes.reclaim(runner.budget.cached)
    assert runner.budget.cached == 0


def test_v4_prompts_cut_inside_their_chunks_in_one_step_give_their_solo_logprobs_and_states(runner):
    """Two prompts (the budget's sequences), each run as pieces split at its own kept boundary, side by side in one
    step: each its solo run's next-token logprobs (within batching's rounding) and its own state at its boundary."""
    from engines.runtime.model_runner import ScheduledChunk

    from .test_v4_batching import V4_BATCH_TOLERANCE
    from .v4_helpers import max_next_token_diff

    prompts = [ids(57 + i, n) for i, n in enumerate((300, 530))]

    def run(group: list[list[int]]) -> list[torch.Tensor]:
        seqs = [admitted(runner, p) for p in group]
        out = runner.execute([ScheduledChunk(seq=s, start=0, end=len(s.token_ids), all_logits=True) for s in seqs])
        positions = sorted(s.position for s in runner.prefixes._states.values())
        for seq in seqs:
            runner.release(seq)
        runner.prefixes.reclaim(runner.budget.cached)
        return [torch.log_softmax(o.float(), dim=-1) for o in out], positions

    together, kept = run(prompts)
    assert kept == [2 * PAGE, 4 * PAGE]
    for prompt, batched in zip(prompts, together):
        (solo,), _ = run([prompt])
        assert max_next_token_diff(batched, solo, prompt) < V4_BATCH_TOLERANCE
