"""The retention over a paged cache as the vLLM plugin's GPU path computes it (flexkv.integrations.vllm.paged):
torch alone, against hand-worked tables and a dense reference written from docs/vllm.md
(benchmarks/cuda_paged.py, whose compiled run on a device is `benchmarks.cuda_check`'s paged section)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the repository, not part of the package
    sys.path.insert(0, str(ROOT))

from benchmarks import cuda_paged  # noqa: E402
from flexkv.cache.positions.masks import query_window_attends  # noqa: E402
from flexkv.integrations.vllm.paged import paged_batch, physical_to_logical, query_positions, retention_block_mask  # noqa: E402

SHAPE = cuda_paged.shape_for(False)  # sink 4, window 28, blocks of 16


def test_the_module_runs_without_vllm():
    code = ("import sys, flexkv.integrations.vllm.paged; "
            "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_physical_to_logical_by_hand():
    """Request 0 (stream of 70: logical blocks 0-4) holds physical 5, 0 (freed), 0, 7, 2 and a stale 9 past its
    stream; request 1 (stream of 17) holds 3 at logical 0 and 9 at logical 1."""
    table = torch.tensor([[5, 0, 0, 7, 2, 9], [3, 9, 0, 0, 0, 0]])
    batch = paged_batch(table, [70, 17], [1, 2], block_size=16, num_blocks=10)
    got = physical_to_logical(batch)
    want = torch.full((2, 10), -1)
    want[0, 5], want[0, 7], want[0, 2] = 0, 3, 4
    want[1, 3], want[1, 9] = 0, 1
    assert torch.equal(got, want)
    assert query_positions(batch).tolist() == [69, 15, 16]


def test_the_block_mask_lists_exactly_the_blocks_its_rows_read():
    """For every query block: the listed physical blocks are exactly those holding an entry one of its rows
    attends (complete: nothing read is missed; tight: nothing else for rows of real tokens, the null block
    never), and the mask at
    every (row, slot) is the retention's on logical indices, false for a slot of another request."""
    for lens, qlens in (([70, 41, 200], [1, 1, 1]), ([90, 30, 64, 150], [40, 8, 1, 1]), ([600], [33])):
        sc = cuda_paged.scene(SHAPE, lens, qlens, torch.float32, "cpu", seed=len(lens), rows=48)
        batch, bs = sc.batch, SHAPE.block_size
        mask = retention_block_mask(batch, SHAPE.sink, SHAPE.window, SHAPE.q_block)
        slots = batch.num_blocks * bs
        pos, doc = query_positions(batch), batch.doc_ids
        want = torch.zeros(batch.doc_ids.shape[0], slots, dtype=torch.bool)  # from the table, by hand
        for row in range(want.shape[0]):
            r, p = int(doc[row]), int(pos[row])
            for j in range(min(p + 1, lens[r])):
                if query_window_attends(j, p, SHAPE.sink, SHAPE.window):
                    phys = int(batch.block_table[r, j // bs])
                    assert phys > 0, (row, j)  # the scene frees only what no query reads
                    want[row, phys * bs + j % bs] = True
        got = mask.mask_mod(torch.tensor(0), torch.tensor(0), torch.arange(want.shape[0])[:, None],
                            torch.arange(slots)[None, :])
        assert torch.equal(got, want)
        for g in range(mask.kv_num_blocks.shape[-1]):
            n = int(mask.kv_num_blocks[0, 0, g])
            listed = mask.kv_indices[0, 0, g, :n].tolist()
            rows = range(g * SHAPE.q_block, (g + 1) * SHAPE.q_block)
            read = want[rows.start:rows.stop].view(-1, batch.num_blocks, bs).any(-1).any(0)
            read = set(read.nonzero().flatten().tolist())
            assert listed == sorted(listed) and 0 not in listed and read <= set(listed)
            if rows.stop <= sc.tokens:  # a padding row (past its stream) may list its window's first block
                assert set(listed) == read


def test_the_step_is_planned_from_shapes_alone():
    """No data-dependent shape or host read: the plan and the sink scores trace on the meta device."""
    sc = cuda_paged.scene(SHAPE, [90, 30, 64, 150], [40, 8, 1, 1], torch.float32, "cpu")
    meta = type(sc.batch)(*(x.to("meta") if torch.is_tensor(x) else x for x in sc.batch))
    mask = retention_block_mask(meta, SHAPE.sink, SHAPE.window, SHAPE.q_block)
    assert mask.kv_indices.shape == (1, 1, 4, meta.num_blocks)
    scores = cuda_paged.sink_scores(sc.query.to("meta"), sc.key_cache.to("meta"), meta, SHAPE.sink, SHAPE.window,
                                    0.25, cuda_paged.rotary_table(151, SHAPE.head_dim, "meta"), True)
    assert scores.shape == (sc.query.shape[0], SHAPE.kv_heads * SHAPE.group, SHAPE.sink)


@pytest.mark.parametrize("positions", ["cache", "stream"])
def test_one_flexattention_call_attends_what_the_docs_say(positions):
    """Eager FlexAttention over the plan, a decoding batch and a chunked one, against the dense float64
    reference; the two position modes differ on these steps (the reference can tell them apart)."""
    for lens, qlens in (([70, 41, 200], [1, 1, 1]), ([90, 30, 64, 150], [40, 8, 1, 1])):
        sc = cuda_paged.scene(SHAPE, lens, qlens, torch.float32, "cpu", rows=sum(qlens) + 3)
        table = cuda_paged.rotary_table(max(lens) + 1, SHAPE.head_dim, "cpu")
        out = cuda_paged.layer(cuda_paged.attend, sc, table, SHAPE, in_cache=positions == "cache")
        ref = cuda_paged.reference(sc, SHAPE, positions)
        assert cuda_paged.relative_error(out[:sc.tokens], ref) < 1e-6
        other = cuda_paged.reference(sc, SHAPE, "stream" if positions == "cache" else "cache")
        assert cuda_paged.relative_error(out[:sc.tokens], other) > 1e-2
