"""The paged latent cache's bookkeeping: prefix pages shared by reference, reclaimed least recently used, and
never handed out while a sequence holds them. Pure CPU, no model."""
from __future__ import annotations

import torch

from engines.kt.families.deepseek_mla.kv_cache import BlockTable, LatentKVCache

PAGE = 4


def cache(pages: int, prefix_cache: bool = True) -> LatentKVCache:
    return LatentKVCache(layer_devices=[torch.device("cpu")], num_tokens=pages * PAGE, latent_dim=2, rope_dim=1,
                         dtype=torch.float32, block_size=PAGE, prefix_cache=prefix_cache)


def run(c: LatentKVCache, tokens: list[int], key: str = "", reuse: bool = True) -> tuple[BlockTable, int]:
    """Admit, compute and index a sequence's tokens the way the runner does; return its table and hit."""
    table = BlockTable()
    hit = c.admit(table, tokens, key, reuse=reuse)
    assert hit is not None
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
    holder, _ = run(c, list(range(8)))  # 2 pages in use
    assert c.admit(BlockTable(), list(range(100, 112)), "") is None  # 3 more would exceed 4
    small, _ = run(c, [7])
    assert not set(small.blocks) & set(holder.blocks)
    assert c.read(0, c.slots(holder, 0, 8))[1].flatten().tolist() == list(range(8))


def test_admission_takes_the_pages_the_tokens_fill_not_their_future():
    c = cache(4)
    run(c, list(range(8)))
    run(c, list(range(100, 108)))  # 2 + 2 pages: the pool is full, whatever either will generate
    assert c.used_tokens == 4 * PAGE
    assert c.admit(BlockTable(), [5], "") is None


def test_admission_leaves_the_growth_margin_free():
    c = cache(4)
    run(c, list(range(4)))
    assert c.admit(BlockTable(), list(range(100, 108)), "", margin=2) is None  # 1 + 2 pages leave 1 free
    assert c.admit(BlockTable(), list(range(100, 108)), "", margin=1) == 0


def test_a_sequence_grows_page_by_page_until_the_cache_is_full():
    c = cache(3)
    first, _ = run(c, list(range(4)))
    second, _ = run(c, list(range(10, 14)))
    assert c.grow(first, 5) and len(first.blocks) == 2
    assert c.grow(first, 8)  # within its second page: nothing taken
    assert not c.grow(second, 5) and len(second.blocks) == 1  # refused: nothing changes
    c.release(first)
    assert c.grow(second, 5) and len(second.blocks) == 2


def test_borrowing_a_cached_page_uses_up_room_for_others():
    c = cache(3)
    table, _ = run(c, list(range(9)))  # two full pages cached after release, one private freed
    c.release(table)
    assert c.used_tokens == 0
    borrower = BlockTable()
    assert c.admit(borrower, list(range(9)), "") == 2 * PAGE  # borrows 2, takes 1: the pool is full
    assert c.admit(BlockTable(), [5], "") is None
    c.release(borrower)
    assert c.admit(BlockTable(), [5], "") == 0


def test_a_prompt_waits_for_the_pages_another_sequence_is_still_computing():
    c = cache(16)
    leader = BlockTable()
    prompt = list(range(13))  # three full pages
    assert c.admit(leader, prompt, "") == 0  # admitted, nothing computed yet
    follower = list(range(12)) + [99]
    assert c.in_flight(BlockTable(), follower, "", [(leader, prompt, 0)])
    c.offer(leader, prompt, 13, "")  # the leader's step ran: its full pages are cached
    assert not c.in_flight(BlockTable(), follower, "", [(leader, prompt, 13)])
    assert c.admit(BlockTable(), follower, "") == 3 * PAGE


def test_nothing_is_waited_for_that_another_sequence_will_not_offer():
    c = cache(16)
    leader = BlockTable()
    prompt = list(range(13))
    c.admit(leader, prompt, "")
    assert not c.in_flight(BlockTable(), [99] + prompt[1:], "", [(leader, prompt, 0)])  # another first page
    assert not c.in_flight(BlockTable(), prompt, "adapter\0" + "1", [(leader, prompt, 0)])  # another key
    assert not c.in_flight(BlockTable(), prompt, "", [(leader, prompt, 8)])  # it computed those pages already
    assert not cache(16, prefix_cache=False).in_flight(BlockTable(), prompt, "", [(leader, prompt, 0)])
