"""Long prompt chunks in blocks of queries (engines/kt/families/deepseek_v4/blocks.py): a chunk whose attention
and indexer scores are computed a block at a time gives the streams of the whole chunk at once."""
from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from engines.kt.families.deepseek_v4 import blocks
from engines.kt.families.deepseek_v4.batch import Piece, V4Batch
from engines.lora.modules import LoraContext
from .v4_helpers import v4_reference_model

# float32 everywhere: only the matrix products' tiling and the order of sums over fewer keys differ
RELATIVE = 1e-5


@pytest.fixture(scope="module")
def reference(v4_model_dir):
    model = v4_reference_model(v4_model_dir)
    assert blocks.install_blocked_scorers(model) > 0
    return model


def _streams(batch: V4Batch, ids: list[int], cuts: list[int]) -> torch.Tensor:
    """The last layer's streams of every position of `ids`, prefilled in chunks ending at `cuts`."""
    cache, out, start = DynamicCache(config=batch.config), [], 0
    for end in cuts:
        out.append(batch.hidden_streams([Piece(ids, start, end, cache, None)]))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("cuts", [[300], [140, 300]], ids=["one-chunk", "after-a-chunk"])
def test_a_chunk_attended_in_blocks_gives_the_streams_of_the_whole_chunk(reference, monkeypatch, cuts):
    """The tiny V4 (a 16-position window, CSA every 4 keeping 4 entries, HCA every 128) over 300 positions: blocks
    of 16 queries, each over its window's keys and every compressed entry, after a chunk whose window it keeps."""
    batch = V4Batch(reference, LoraContext())
    ids = torch.randint(100, 120000, (cuts[-1],), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        whole = _streams(batch, ids, cuts)
        rows = []  # queries of each attention call a prompt chunk makes
        attend = blocks.attend_in_blocks

        def counted(fn, *args):
            def recorded(q, *rest):
                rows.append(q.shape[2])
                return fn(q, *rest)
            return attend(recorded, *args)

        monkeypatch.setattr(blocks, "BLOCK_BYTES", 4096)
        monkeypatch.setattr("engines.kt.families.deepseek_v4.batch.attend_in_blocks", counted)
        blocked = _streams(batch, ids, cuts)
    assert max(rows) == 16  # every chunk (140 or 160 rows and more) went through blocks of 16 queries
    assert ((blocked - whole).abs().max() / whole.abs().max()).item() < RELATIVE


def test_indexer_scores_in_blocks_are_the_scores_of_every_query_at_once(reference, monkeypatch):
    scorer = next(m for m in reference.modules() if hasattr(m, "weights_proj"))
    heads = scorer.weights_proj.out_features
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, 200, heads, 32, generator=generator)
    keys = torch.randn(1, 50, 32, generator=generator)
    hidden = torch.randn(1, 200, scorer.weights_proj.in_features, generator=generator)
    with torch.inference_mode():
        whole = blocks.blocked_scores(scorer, q, keys, hidden)
        monkeypatch.setattr(blocks, "BLOCK_BYTES", heads * 50 * 4 * 20)
        assert blocks.block_rows(200, heads * 50 * 4) == 16
        blocked = blocks.blocked_scores(scorer, q, keys, hidden)
    assert torch.allclose(blocked, whole, rtol=1e-6, atol=1e-6)
