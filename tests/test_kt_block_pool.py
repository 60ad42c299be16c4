"""The paged latent cache's bookkeeping: prefix pages shared by reference, reclaimed least recently used, and
never handed out while a sequence holds them. Pure CPU, no model."""
from __future__ import annotations

import torch

from engines.kt.kv_cache import BlockTable, LatentKVCache

PAGE = 4


def cache(pages: int, prefix_cache: bool = True) -> LatentKVCache:
    return LatentKVCache(layer_devices=[torch.device("cpu")], num_tokens=pages * PAGE, latent_dim=2, rope_dim=1,
                         dtype=torch.float32, block_size=PAGE, prefix_cache=prefix_cache)


def run(c: LatentKVCache, tokens: list[int], extra: int = 0, key: str = "", reuse: bool = True
        ) -> tuple[BlockTable, int]:
    """Admit, compute and index a sequence's tokens the way the runner does; return its table and hit."""
    table = BlockTable()
    hit = c.admit(table, tokens, len(tokens) + extra, key, reuse=reuse)
    assert hit is not None
    c.ensure(table, len(tokens))
    values = torch.tensor(tokens[hit:], dtype=torch.float32).unsqueeze(1)
    c.write(0, c.slots(table, hit, len(tokens)), values.expand(-1, 2), values)
    c.offer(table, tokens, len(tokens), key)
    return table, hit


def test_a_repeated_prefix_borrows_the_same_pages():
    c = cache(8)
    first, hit = run(c, list(range(10)))
    assert hit == 0
    second, hit = run(c, list(range(9)) + [99])
    assert hit == 2 * PAGE and second.blocks[:2] == first.blocks[:2]
    assert second.blocks[2] != first.blocks[2]


def test_the_last_prompt_token_is_always_computed():
    c = cache(8)
    run(c, list(range(8)))
    _, hit = run(c, list(range(8)))
    assert hit == PAGE  # two full pages are cached, but the second holds the last token


def test_released_pages_stay_cached_but_count_as_free():
    c = cache(8)
    table, _ = run(c, list(range(8)))
    c.release(table)
    assert c.used_tokens == 0 and c.cached_tokens == 2 * PAGE
    _, hit = run(c, list(range(9)))
    assert hit == 2 * PAGE


def test_different_keys_never_share_pages():
    c = cache(8)
    base, _ = run(c, list(range(9)), key="")
    other, hit = run(c, list(range(9)), key="adapter\0" + "1")
    assert hit == 0 and not set(base.blocks) & set(other.blocks)


def test_without_prefix_caching_nothing_is_reused():
    c = cache(8, prefix_cache=False)
    table, _ = run(c, list(range(9)))
    c.release(table)
    _, hit = run(c, list(range(9)))
    assert hit == 0 and c.cached_tokens == 0


def test_prompt_logprob_sequences_compute_everything_but_still_share_what_they_computed():
    c = cache(8)
    _, hit = run(c, list(range(9)), reuse=False)
    assert hit == 0
    _, hit = run(c, list(range(9)))
    assert hit == 2 * PAGE


def test_cached_pages_are_reclaimed_least_recently_used_first():
    c = cache(4)
    old, _ = run(c, [1] * 5)  # pages: [1]*4 cached, tail page private
    c.release(old)
    recent, _ = run(c, [2] * 5)
    c.release(recent)
    newcomer, _ = run(c, [3] * 12)  # 3 pages: the 2 free ones, then the least recently used cached one
    c.release(newcomer)
    _, hit_recent = run(c, [2] * 5)
    _, hit_old = run(c, [1] * 5)
    assert (hit_old, hit_recent) == (0, PAGE)


def test_pages_in_use_are_never_reclaimed_and_admission_waits_for_room():
    c = cache(4)
    holder, _ = run(c, list(range(8)), extra=4)  # 2 pages in use, 1 more promised
    assert c.admit(BlockTable(), list(range(100, 108)), 8, "") is None  # 2 more would exceed 4
    small, _ = run(c, [7])
    assert not set(small.blocks) & set(holder.blocks)
    assert c.read(0, c.slots(holder, 0, 8))[1].flatten().tolist() == list(range(8))
    c.ensure(holder, 12)  # the promised page is still there for the holder
    assert len(set(holder.blocks) | set(small.blocks)) == 4


def test_borrowing_a_cached_page_uses_up_room_for_others():
    c = cache(3)
    table, _ = run(c, list(range(9)))  # two full pages cached after release, one private freed
    c.release(table)
    assert c.used_tokens == 0
    borrower = BlockTable()
    assert c.admit(borrower, list(range(9)), 9, "") == 2 * PAGE  # borrows 2, promises 1: the pool is full
    assert c.admit(BlockTable(), [5], 1, "") is None
    c.release(borrower)
    assert c.admit(BlockTable(), [5], 1, "") == 0


def test_a_prompt_waits_for_the_pages_another_sequence_is_still_computing():
    c = cache(16)
    leader = BlockTable()
    prompt = list(range(13))  # three full pages
    assert c.admit(leader, prompt, 13, "") == 0  # admitted, nothing computed yet
    follower = list(range(12)) + [99]
    assert c.in_flight(BlockTable(), follower, "", [(leader, prompt, 0)])
    c.ensure(leader, 13)
    c.offer(leader, prompt, 13, "")  # the leader's step ran: its full pages are cached
    assert not c.in_flight(BlockTable(), follower, "", [(leader, prompt, 13)])
    assert c.admit(BlockTable(), follower, 13, "") == 3 * PAGE


def test_nothing_is_waited_for_that_another_sequence_will_not_offer():
    c = cache(16)
    leader = BlockTable()
    prompt = list(range(13))
    c.admit(leader, prompt, 13, "")
    assert not c.in_flight(BlockTable(), [99] + prompt[1:], "", [(leader, prompt, 0)])  # another first page
    assert not c.in_flight(BlockTable(), prompt, "adapter\0" + "1", [(leader, prompt, 0)])  # another key
    assert not c.in_flight(BlockTable(), prompt, "", [(leader, prompt, 8)])  # it computed those pages already
    assert not cache(16, prefix_cache=False).in_flight(BlockTable(), prompt, "", [(leader, prompt, 0)])
