"""The planner's block lists and cell intervals against FlexAttention's own `create_block_mask`.

For each row of a planned step, the cells every query may read come from the
reference definition (`flexkv.model.reference.attended_indices`) placed by the
layout rule (`flexkv.cli.show.entry_cell`). `create_block_mask` over that dense
mask, `.to_dense()`, gives the KV blocks holding any readable cell and, from
its full-block lists, the blocks every query reads whole. The planner's
lists must be exactly those, on lengths chosen to straddle block edges.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask

from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cache.host.layout import entry_cell
from flexkv.cache.paths.attention_options import AttentionOptions
from flexkv.model.reference import attended_indices, own_stream_indices

CONFIGS = {
    # Source longer than the sinks, ring of 13 cells over blocks of 8: slot rows start mid-block.
    "source-sinks": dict(rows_per_request=1, max_source_len=7, max_sources=2, retention=SinkWindow(3, 10),
                         max_step_tokens=3, max_slots=3),
    # Sinks longer than a short source (sink region in the slot), two CFG rows, reverse order.
    "cfg-reverse": dict(rows_per_request=2, max_source_len=3, max_sources=1, min_source_len=1,
                        retention=SinkWindow(5, 9), max_step_tokens=4, max_slots=2, reverse_step_order=True),
    # No source, a window that counts the step, a ring of exactly two blocks.
    "window-includes-step": dict(rows_per_request=1, max_source_len=0, max_sources=0,
                                 retention=SinkWindow(2, 14, window_includes_step=True), max_step_tokens=2,
                                 max_slots=4),
    # A per-step window causal inside the step (a ring of C = 12 keys): queries share the window,
    # not the step's later tokens; a source longer than the sinks.
    "causal-step": dict(rows_per_request=1, max_source_len=4, max_sources=1, retention=SinkWindow.keys(12, sink=2),
                        causal_step=True, max_step_tokens=4, max_slots=3),
    # The same with no source and no sink: slot rows of two whole blocks, so whole blocks hold own tokens.
    "causal-step-aligned": dict(rows_per_request=1, max_source_len=0, max_sources=0, retention=SinkWindow.keys(12),
                                causal_step=True, max_step_tokens=4, max_slots=3),
    # Per-query windows: every query reads a different set.
    "per-query": dict(rows_per_request=1, max_source_len=5, max_sources=1, retention=SinkWindow(2, 11),
                      query_window=9, max_step_tokens=3, max_slots=2),
}
BLOCK = 8


def _manager(name, full_blocks):
    cfg = BoundedKVConfig(num_layers=1, num_heads=1, head_dim=4, **CONFIGS[name])
    m = BoundedKVManager(cfg, "meta", block_size=BLOCK,
                         options=AttentionOptions.for_cache(cfg, "meta", full_blocks=full_blocks))
    return m


def _readable(m, plan, i, source_len, written, span, tokens):
    """[T, S] bool: the cells each query of flat row `i` may read, from the reference definition."""
    cfg, lay = m.config, m.layout
    row = plan.row(i)
    out = torch.zeros(tokens, lay.total_len, dtype=torch.bool)
    own = own_stream_indices(source_len + written, span, tokens, cfg.reverse_step_order)
    for t, entries in enumerate(attended_indices(cfg, source_len, written, span, tokens)):
        for j in entries:
            if j in own:  # the step's own tokens sit where the plan writes them
                out[t, plan.write_cells(i)[own.index(j)]] = True
            else:
                out[t, entry_cell(row, lay.ring_len, j)[1]] = True
    return out


def _blocks_of(block_mask, full: bool) -> list:
    num = block_mask.full_kv_num_blocks if full else block_mask.kv_num_blocks
    idx = block_mask.full_kv_indices if full else block_mask.kv_indices
    if num is None:
        return []
    return sorted(idx[0, 0, 0, : int(num[0, 0, 0])].tolist())


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(sorted(CONFIGS)),
    full_blocks=st.booleans(),
    data=st.data(),
)
def test_planner_blocks_match_create_block_mask(name, full_blocks, data):
    m = _manager(name, full_blocks)
    cfg = m.config
    T = data.draw(st.integers(1, cfg.max_step_tokens), label="T")
    span = data.draw(st.integers(0, T), label="span")
    L = data.draw(st.integers(cfg.min_source_len, cfg.max_source_len), label="source_len")
    written = data.draw(st.integers(0, 4 * cfg.window_capacity), label="written")
    slot_pad = data.draw(st.integers(0, cfg.max_slots - 1), label="slots taken before")
    if cfg.max_source_len:
        shape = (1, cfg.rows_per_request, 1, cfg.max_source_len, 4)
        for _ in range(cfg.max_sources):
            m.add_source(torch.zeros(shape, device="meta"), torch.zeros(shape, device="meta"))
    source = data.draw(st.integers(0, max(cfg.max_sources - 1, 0)), label="source")
    for k in range(slot_pad):  # move the request off slot 0
        m.admit(BoundedKVStep((Segment(f"other{k}", 1),), {f"other{k}": StreamPosition(0 if not cfg.min_source_len else L, 0, source)}))
    segs = (Segment(None, 0), Segment("r", span))
    m.admit(BoundedKVStep(segs, {"r": StreamPosition(L, 0, source)}, tokens=T))
    plan = m.plan(BoundedKVStep(segs, {"r": StreamPosition(L, written, source)}, tokens=T))

    _check_rows(m, plan, 1, L, written, span, T, full_blocks)


def _check_rows(m, plan, first_segment, L, written, span, T, full_blocks):
    """Segments before `first_segment` are padding; the one at it is the request (`L`, `written`)."""
    R = m.config.rows_per_request
    for i in range(first_segment * R):  # padding rows read nothing
        assert plan.blocks(i) == [] and plan.blocks(i, full=True) == [] and plan.cell_intervals(i) == []
    for i in range(first_segment * R, (first_segment + 1) * R):
        dense = _readable(m, plan, i, L, written, span, T)
        bm = create_block_mask(lambda b, h, q, kv: dense[q, kv], 1, 1, T, m.layout.total_len,
                               device="cpu", BLOCK_SIZE=(T, BLOCK))
        touched = bm.to_dense()[0, 0, 0].nonzero().flatten().tolist()
        full = _blocks_of(bm, True) if full_blocks else []
        assert sorted(plan.blocks(i, full=True)) == full, (written, span, T)
        assert sorted(plan.blocks(i)) == sorted(set(touched) - set(full)), (written, span, T)
        # The row's cell intervals are exactly the cells some query reads.
        cells = dense.any(dim=0).nonzero().flatten().tolist()
        covered = [c for lo, hi in plan.cell_intervals(i) for c in range(lo, hi)]
        assert covered == cells


def test_causal_step_full_blocks_hold_only_cells_every_query_reads():
    """Every position of a ring of two whole blocks: a block is full only when every query of the
    step reads all of it, so a block holding own tokens after the step's first is never full."""
    m = _manager("causal-step-aligned", True)
    seen_full_with_own = 0
    for T in (1, 2, 4):
        for span in sorted({0, T // 2, T}):
            for written in range(0, 3 * m.layout.ring_len):
                segs = (Segment("r", span),)
                m.admit(BoundedKVStep(segs, {"r": StreamPosition(0, 0)}, tokens=T))
                plan = m.plan(BoundedKVStep(segs, {"r": StreamPosition(0, written)}, tokens=T))
                _check_rows(m, plan, 0, 0, written, span, T, True)
                own = set(plan.write_cells(0))
                seen_full_with_own += any(c // BLOCK in plan.blocks(0, full=True) for c in own)
                m.remove_request("r")
    assert seen_full_with_own  # the first own token does sit in full blocks


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_block_lists_are_as_wide_as_one_row_reaches(name):
    """The plan's lists do not grow with the pool: a pool of 64 slots plans as wide as one of 2."""
    cfg = BoundedKVConfig(num_layers=1, num_heads=1, head_dim=4, **CONFIGS[name])
    small = BoundedKVManager(cfg, "meta", block_size=BLOCK).layout
    big = BoundedKVManager(cfg.replace(max_slots=64), "meta", block_size=BLOCK).layout
    assert small.row_blocks == big.row_blocks < big.num_blocks
