"""V4 decode rows over the paged caches (engines/kt/families/deepseek_v4/paged.py): a sequence whose prefilled
cache moved into the pools decodes as it would over transformers' cache layers, batched with others, and gives its
slot and pages back when it ends."""
from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from engines.kt.families.deepseek_v4.batch import Piece, V4Batch
from engines.kt.families.deepseek_v4.caches import SequenceCache
from engines.kt.families.deepseek_v4.paged import PAGE, PagedDecode
from engines.lora.modules import LoraContext
from tests.helpers import require_kt_kernel
from .v4_helpers import load_v4_runner, runner_sequence, v4_reference_model

# (prompt, decoded) positions: the tiny V4 has a 16-position window, CSA every 4 (the indexer keeps 4 entries) and HCA
# every 128; these cross the window's wrap, CSA windows with more entries than the indexer keeps, an HCA window
# closing while decoding (140 + 116 = 256) and HCA entries moved in with the prompt (300)
LENGTHS = [(300, 20), (140, 120), (10, 30), (3, 40)]
# float32 everywhere, the experts in torch: only the order of the keys in attention's sums differs (measured
# 4.1e-7 of the largest stream entry at worst over these sequences)
RELATIVE = 1e-5


@pytest.fixture(scope="module")
def reference(v4_model_dir):
    return v4_reference_model(v4_model_dir)


def _prefilled(batch: V4Batch, ids: list[int], prompt: int) -> SequenceCache:
    state = SequenceCache(DynamicCache(config=batch.config))
    batch.hidden_streams([Piece(ids, 0, prompt, state.cache, None)])
    state.computed = prompt
    return state


def test_paged_decode_rows_give_the_streams_of_decoding_over_transformers_caches(reference):
    batch = V4Batch(reference, LoraContext())
    batch.paged = PagedDecode(reference)
    generator = torch.Generator().manual_seed(3)
    sequences = []
    with torch.inference_mode():
        for prompt, decoded in LENGTHS:
            ids = torch.randint(100, 120000, (prompt + decoded,), generator=generator).tolist()
            dynamic, paged = _prefilled(batch, ids, prompt), _prefilled(batch, ids, prompt)
            paged.adopt(batch.paged)
            sequences.append((ids, dynamic, paged))
        positions = [prompt for prompt, _ in LENGTHS]
        worst = 0.0
        while True:
            active = [i for i, (ids, _, _) in enumerate(sequences) if positions[i] < len(ids)]
            if not active:
                break
            rows = [(sequences[i], positions[i]) for i in active]
            expected = batch.hidden_streams([Piece(ids, p, p + 1, dynamic.cache, None) for (ids, dynamic, _), p in rows])
            got = batch.hidden_streams([Piece(ids, p, p + 1, None, None, paged=paged.paged)
                                        for (ids, _, paged), p in rows])
            worst = max(worst, ((got - expected).abs().max() / expected.abs().max()).item())
            for i in active:
                positions[i] += 1
    assert worst < RELATIVE


def test_a_paged_step_run_again_gives_the_same_streams(reference):
    batch = V4Batch(reference, LoraContext())
    batch.paged = PagedDecode(reference)
    ids = torch.randint(100, 120000, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        state = _prefilled(batch, ids, 31)  # position 31 closes a CSA window
        state.adopt(batch.paged)
        first = batch.hidden_streams([Piece(ids, 31, 32, None, None, paged=state.paged)])
        state.commit(32)
        state.begin(31)  # the step again, as after a failure elsewhere in it
        assert state.computed == 31
        again = batch.hidden_streams([Piece(ids, 31, 32, None, None, paged=state.paged)])
    assert torch.equal(first, again)


def test_decode_steps_padded_to_their_bucket_and_page_widths_give_the_streams_of_the_steps_as_they_are(reference):
    from engines.kt.families.deepseek_v4.graphs import V4StepGraphs

    # 530 positions fill three CSA pages (tables padded to four); three rows padded to four, then two, then one
    lengths = [(530, 14), (300, 8), (10, 4)]
    as_is, padded = V4Batch(reference, LoraContext()), V4Batch(reference, LoraContext())
    # the padded side as a GPU engine's: pools sized to a budget before any sequence, blank steps run over them
    # (what load-time captures warm up with: every bucket's one-page step, one row at each wider page width) before
    # the sequences move in
    as_is.paged, padded.paged = PagedDecode(reference), PagedDecode(reference, sequences=3, positions=2048)
    whole = V4StepGraphs(padded, 8, torch.device("cpu"))  # not captured: the whole step runs eagerly
    generator = torch.Generator().manual_seed(13)
    sequences = []
    with torch.inference_mode():
        padded.paged.prepare(torch.float32)
        whole._whole(4, padded.paged.blank_step(4))
        for pages in padded.paged.widths_up_to(2048)[1:]:
            whole._whole(1, padded.paged.blank_step(1, pages))
        for prompt, decoded in lengths:
            ids = torch.randint(100, 120000, (prompt + decoded,), generator=generator).tolist()
            mine, theirs = _prefilled(as_is, ids, prompt), _prefilled(padded, ids, prompt)
            mine.adopt(as_is.paged)
            theirs.adopt(padded.paged)
            sequences.append((ids, mine, theirs))
        positions = [prompt for prompt, _ in lengths]
        worst, steps = 0.0, 0
        while active := [i for i, (ids, _, _) in enumerate(sequences) if positions[i] < len(ids)]:
            rows = [(sequences[i], positions[i]) for i in active]
            expected = as_is.hidden_streams([Piece(ids, p, p + 1, None, None, paged=mine.paged)
                                             for (ids, mine, _), p in rows])
            got = whole.hidden_streams([Piece(ids, p, p + 1, None, None, paged=theirs.paged)
                                        for (ids, _, theirs), p in rows])
            worst = max(worst, ((got - expected).abs().max() / expected.abs().max()).item())
            steps += 1
            for i in active:
                positions[i] += 1
    assert whole.whole_steps == steps == 14
    assert worst < RELATIVE


def test_a_slot_and_pages_given_back_and_taken_again_decode_in_padded_steps_as_fresh_ones(reference):
    from engines.kt.families.deepseek_v4.graphs import V4StepGraphs

    fresh, reused = V4Batch(reference, LoraContext()), V4Batch(reference, LoraContext())
    fresh.paged, reused.paged = PagedDecode(reference), PagedDecode(reference, sequences=1, positions=512)
    whole = V4StepGraphs(reused, 4, torch.device("cpu"))
    generator = torch.Generator().manual_seed(19)
    # the second prompt is shorter than the window (16): its ring rows past it still hold the first one's keys
    first, second = (torch.randint(100, 120000, (n,), generator=generator).tolist() for n in (300, 40))
    with torch.inference_mode():
        earlier = _prefilled(reused, first, 290)
        earlier.adopt(reused.paged)
        for p in range(290, 300):  # fills the slot's rings and the pages with the first sequence's rows
            whole.hidden_streams([Piece(first, p, p + 1, None, None, paged=earlier.paged)])
        slot, pages = earlier.paged.slot, dict(earlier.paged.pages)
        reused.paged.release(earlier.paged)
        mine, theirs = _prefilled(fresh, second, 5), _prefilled(reused, second, 5)
        mine.adopt(fresh.paged)
        theirs.adopt(reused.paged)
        assert theirs.paged.slot == slot and theirs.paged.pages[4][0] in pages[4]
        worst = 0.0
        for p in range(5, 40):
            expected = fresh.hidden_streams([Piece(second, p, p + 1, None, None, paged=mine.paged)])
            got = whole.hidden_streams([Piece(second, p, p + 1, None, None, paged=theirs.paged)])
            worst = max(worst, ((got - expected).abs().max() / expected.abs().max()).item())
    assert worst < RELATIVE


def _same_step(a, b) -> bool:
    return a.key == b.key and all(torch.equal(x[n], y[n]) for (x, n), (y, _) in zip(a._tensors(), b._tensors()))


def test_the_next_decode_step_made_ahead_is_the_step_made_at_its_turn_except_where_it_opens_a_page(reference):
    from engines.kt.families.deepseek_v4.graphs import V4StepGraphs

    batch = V4Batch(reference, LoraContext())
    batch.paged = PagedDecode(reference, sequences=2, positions=1024)
    whole = V4StepGraphs(batch, 4, torch.device("cpu"))
    generator = torch.Generator().manual_seed(23)
    # the first sequence's CSA entries (one per 4 positions) fill their first page at position 255
    prompts = {250: 262, 100: 112}
    sequences = [(torch.randint(100, 120000, (end,), generator=generator).tolist(), prompt)
                 for prompt, end in prompts.items()]
    with torch.inference_mode():
        batch.paged.prepare(torch.float32)
        states = [_prefilled(batch, ids, prompt) for ids, prompt in sequences]
        for state in states:
            state.adopt(batch.paged)
        paged = [state.paged for state in states]
        ahead, none_at = 0, []
        for step in range(12):
            positions = [prompt + step for _, prompt in sequences]
            made = whole.forecast
            if made is not None:
                ahead += 1
                assert _same_step(made.step, batch.paged.padded_step(paged, positions, 2, torch.device("cpu")))
            whole.hidden_streams([Piece(ids, p, p + 1, None, None, paged=s) for (ids, _), p, s in
                                  zip(sequences, positions, paged)])
            if whole.forecast is None:
                none_at.append(positions[0])
    assert none_at == [255]  # its next row, 256, takes a new page: that step reserves it itself
    assert whole.forecasts_used == ahead == 12 - 2  # not the first step, nor the one after 255


def test_a_step_made_ahead_is_not_taken_once_one_of_its_sequences_gave_its_slot_back(reference):
    from engines.kt.families.deepseek_v4.graphs import V4StepGraphs

    batch = V4Batch(reference, LoraContext())
    batch.paged = PagedDecode(reference, sequences=2, positions=1024)
    whole = V4StepGraphs(batch, 4, torch.device("cpu"))
    ids = torch.randint(100, 120000, (40,), generator=torch.Generator().manual_seed(29)).tolist()
    with torch.inference_mode():
        batch.paged.prepare(torch.float32)
        state = _prefilled(batch, ids, 30)
        state.adopt(batch.paged)
        whole.hidden_streams([Piece(ids, 30, 31, None, None, paged=state.paged)])
        made = whole.forecast
        assert made is not None and made.holds([state.paged], [31], batch.paged.generation)
        batch.paged.release(state.paged)
        assert not made.holds([state.paged], [31], batch.paged.generation)


def test_a_released_sequence_gives_its_slot_and_pages_back(v4_model_dir):
    require_kt_kernel()
    from engines.runtime.model_runner import ScheduledChunk

    runner = load_v4_runner(v4_model_dir)
    ids = torch.randint(100, 120000, (300,), generator=torch.Generator().manual_seed(9)).tolist()
    seq = runner_sequence(ids, prompt=290)
    runner.execute([ScheduledChunk(seq=seq, start=0, end=290)])
    for position in range(290, 300):
        runner.execute([ScheduledChunk(seq=seq, start=position, end=position + 1)])
    assert seq.runner_state.paged is not None
    slots, pages = runner.paged.usage()
    # one slot; per rate, the pages of its entries: CSA 300 // 4 = 75 entries in 2 pages of 64, HCA 2 in 1
    assert (slots, pages) == (1, 2 + 1) and PAGE == 64
    runner.release(seq)
    assert runner.paged.usage() == (0, 0)


def test_the_paged_pools_are_sized_to_the_cache_budget_and_do_not_grow_while_sequences_decode(v4_model_dir):
    require_kt_kernel()
    from engines.runtime.model_runner import ScheduledChunk

    runner = load_v4_runner(v4_model_dir, max_concurrent=3)
    generator = torch.Generator().manual_seed(17)
    sequences = [runner_sequence(torch.randint(100, 120000, (n + 12,), generator=generator).tolist(), prompt=n)
                 for n in (300, 290, 280)]
    for seq in sequences:
        runner.execute([ScheduledChunk(seq=seq, start=0, end=seq.num_prompt_tokens)])
    paged, sized = runner.paged, None
    for step in range(12):
        runner.execute([ScheduledChunk(seq=s, start=s.num_prompt_tokens + step, end=s.num_prompt_tokens + step + 1)
                        for s in sequences])
        sized = paged.generation if sized is None else sized  # the first decode rows sized the pools
    positions = runner.budget.positions
    assert paged.slots == 3 + 1  # every sequence's slot and the scratch slot
    assert paged.pages == {rate: positions // rate // PAGE + 3 + 1 for rate in paged.rates}
    assert paged.generation == sized


def test_a_prompt_fed_a_token_a_step_moves_to_the_paged_caches_at_its_first_decode_row(v4_model_dir):
    require_kt_kernel()
    from engines.runtime.model_runner import ScheduledChunk

    runner = load_v4_runner(v4_model_dir)
    ids = torch.randint(100, 120000, (12,), generator=torch.Generator().manual_seed(11)).tolist()
    seq = runner_sequence(ids, prompt=10)
    for position in range(10):  # a prompt fed a position a step, as a small token budget may cut it
        runner.execute([ScheduledChunk(seq=seq, start=position, end=position + 1)])
        assert seq.runner_state.paged is None
    runner.execute([ScheduledChunk(seq=seq, start=10, end=11)])
    assert seq.runner_state.paged is not None


def test_the_page_widths_listed_for_load_captures_are_those_a_decoding_sequence_meets(reference):
    """graphs.py captures one sequence's whole decode steps at these widths at load, so none waits for a capture
    as its context grows (a capture at first use took ~60 ms at 4 of V4-Flash's layers)."""
    from engines.kt.families.deepseek_v4.paged import PagedSequence

    positions = 70_000  # CSA: 274 pages of 64 entries at the end (width 512), HCA: 9 (width 16)
    pools = PagedDecode(reference, sequences=1, positions=positions)
    pools.prepare(torch.float32, [torch.device("cpu")] * len(pools.layers))
    seq, met = PagedSequence(slot=pools._slot()), []
    for position in range(positions):
        pools.reserve(seq, position)
        widths = pools._widths([seq])
        if not met or met[-1] != widths:
            met.append(widths)
    assert pools.widths_up_to(positions) == met
    assert met[0] == {4: 1, 128: 1} and met[-1] == {4: 512, 128: 16} and len(met) == 10
