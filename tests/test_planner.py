"""Hand-worked plans: the layout's cells, each row's table, the blocks it visits and the cells the mask opens.

Layout used by most cases (block 8, one row per request, one source of at
most 4 entries, 2 slots, SinkWindow(3, 4), max_step_tokens 2):

    sink_capacity = max(3 - L for L in 0..4) = 3, ring = 4 + 2 = 6,
    slot row = 3 + 6 = 9 cells; source cells 0-3; slot 0 at 4 (ring at 7),
    slot 1 at 13 (ring at 16); scratch 22-23; S = 24 = 3 blocks.
"""

from functools import partial

import pytest
import torch

from configs import small_config
from flexkv import BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cache.paths.attention_options import AttentionOptions
from flexkv.cache.positions.masks import make_mask_mod

cfg = partial(small_config, num_layers=1, num_heads=1, head_dim=4, max_source_len=4, max_sources=1,
              retention=SinkWindow(3, 4), max_slots=2, max_step_tokens=2)


def manager(config, source_len=4, full_blocks=False):
    m = BoundedKVManager(config, "cpu", block_size=8,
                         options=AttentionOptions.for_cache(config, "cpu", full_blocks=full_blocks))
    if config.max_source_len:
        shape = (config.num_layers, config.rows_per_request, config.num_heads, source_len, config.head_dim)
        m.add_source(torch.zeros(shape), torch.zeros(shape))
    return m


def open_cells(m, plan, row):
    """Cells the mask lets query 0 of `row` attend (evaluated on every cell)."""
    mask = make_mask_mod(plan, m.layout.ring_len, plan.tokens, m.config.query_window)
    kv = torch.arange(m.layout.total_len)
    b = torch.full_like(kv, row)
    out = []
    for t in range(plan.tokens):
        ok = mask(b, torch.zeros_like(kv), torch.full_like(kv, t), kv)
        out.append(kv[ok].tolist())
    return out


def start(m, segments, positions, tokens=None):
    """Admit the requests (fresh streams), then return the step at the given positions.

    Planning never compares positions with what was committed, so a step far
    into a stream can be planned right after admission.
    """
    fresh = {rid: StreamPosition(p.source_len, 0, p.source) for rid, p in positions.items()}
    m.admit(BoundedKVStep(tuple(segments), fresh, tokens=tokens))
    return BoundedKVStep(tuple(segments), positions, tokens=tokens)


def test_layout_offsets():
    m = manager(cfg())
    lay = m.layout
    assert (lay.sink_len, lay.ring_len, lay.slot_row_len) == (3, 6, 9)
    assert (lay.slot_row(0, 0), lay.slot_row(1, 0), lay.scratch_base, lay.total_len) == (4, 13, 22, 24)


def test_sink_longer_than_source():
    """L=2 < sink 3: stream entry 2 lives in the slot's sink region, entry 3 starts the ring."""
    m = manager(cfg())
    step = start(m, [Segment("a", 2)], {"a": StreamPosition(2, 0)})
    plan = m.plan(step)
    assert plan.row(0) == dict(src_base=0, src_len=2, sink_base=4, ring_start=3, ring_base=7,
                               n=2, n_mod=2, sink=3, lo=3, span=2, src_row=0, slot_row=0)
    # Own tokens: stream 2 -> sink cell 4 + (2 - 2); stream 3 -> ring cell 7 + 3 % 6.
    assert plan.write_cells(0) == [4, 10]
    assert plan.blocks(0) == [0, 1]
    # Attends source 0, 1 (cells 0, 1) and both own tokens (cells 4, 10).
    assert open_cells(m, plan, 0) == [[0, 1, 4, 10]] * 2


def test_ring_wrap_sinks_in_slot():
    """No source, 9 written: sinks 0-2 in the sink region, window 5-8 spread over the wrapped ring."""
    m = manager(cfg())
    step = start(m, [Segment(None, 0), Segment("b", 1)], {"b": StreamPosition(0, 9)}, tokens=1)
    plan = m.plan(step)
    assert m.slot_of("b") == 0
    row = plan.row(1)
    assert (row["n"], row["n_mod"], row["lo"], row["ring_start"]) == (9, 3, 5, 3)
    # Stream 9 -> ring cell 9 % 6 = 3 -> 7 + 3.
    assert plan.write_cells(1) == [10]
    # Sinks 0, 1, 2 at 4, 5, 6; window 5->12, 6->7, 7->8, 8->9; own 9->10. Cell 11 holds evicted entry 4.
    assert open_cells(m, plan, 1) == [[4, 5, 6, 7, 8, 9, 10, 12]]
    # The padding row attends nothing and writes to the scratch cells.
    assert open_cells(m, plan, 0) == [[]]
    assert plan.write_cells(0) == [22]
    assert plan.blocks(0) == []


def test_window_reaches_into_the_source():
    """L=4, SinkWindow(1, 4), 1 written: the window covers source entries 1-3 and written entry 4."""
    m = manager(cfg(retention=SinkWindow(1, 4)))
    step = start(m, [Segment("c", 1)], {"c": StreamPosition(4, 1)}, tokens=1)
    plan = m.plan(step)
    row = plan.row(0)
    # sink_capacity is max(1 - L) = 1 at L=0; ring = 6; slot 0 at 4, ring at 5.
    assert (row["ring_start"], row["lo"], row["ring_base"]) == (4, 1, 5)
    # Stream 4 -> ring 5 + 4; own stream 5 -> ring 5 + 5.
    assert plan.write_cells(0) == [10]
    assert open_cells(m, plan, 0) == [[0, 1, 2, 3, 9, 10]]


def test_reverse_order_with_lookahead():
    """Reverse order, span 2 of T 3: token 0 -> stream n+1, token 1 -> n, look-ahead token 2 -> n+2."""
    m = manager(cfg(max_source_len=0, max_sources=0, retention=SinkWindow(1, 3), reverse_step_order=True,
                    max_step_tokens=3))
    # sink_capacity 1, ring 3 + 3 = 6: slot 0 sink at 0, ring at 1.
    step = start(m, [Segment("d", 2)], {"d": StreamPosition(0, 4)}, tokens=3)
    plan = m.plan(step)
    assert plan.write_cells(0) == [1 + 5, 1 + 4, 1 + 0]
    # Retained: sink 0 (cell 0), window 1..3 (cells 2, 3, 4); own 4, 5, 6 (cells 5, 6, 1).
    assert open_cells(m, plan, 0) == [[0, 1, 2, 3, 4, 5, 6]] * 3


def test_lookahead_only_step_reads_without_writing_the_stream():
    """span 0 with T 2: the tokens are attended, written to ring cells past the stream, and not committed."""
    m = manager(cfg(max_source_len=0, max_sources=0, retention=SinkWindow(0, 2)))
    step = start(m, [Segment("e", 0)], {"e": StreamPosition(0, 5)}, tokens=2)
    plan = m.plan(step)
    # ring = 2 + 2 = 4 at cell 0: window 3, 4 at cells 3, 0; own 5, 6 at cells 1, 2.
    assert plan.write_cells(0) == [1, 2]
    assert open_cells(m, plan, 0) == [[0, 1, 2, 3]] * 2
    m.commit(step)
    assert m.written("e") == 5


def test_per_query_window_with_sink():
    m = manager(cfg(max_source_len=0, max_sources=0, retention=SinkWindow(1, 3), query_window=2,
                    max_step_tokens=2))
    step = start(m, [Segment("f", 2)], {"f": StreamPosition(0, 6)}, tokens=2)
    plan = m.plan(step)
    # sink at cell 0, ring of 5 at cell 1: stream j (j >= 1) -> 1 + j % 5.
    # Query 6 attends sink 0 and 4, 5, 6; query 7 attends 0 and 5, 6, 7.
    got = open_cells(m, plan, 0)
    cell = lambda j: 0 if j == 0 else 1 + j % 5
    assert got == [sorted(cell(j) for j in (0, 4, 5, 6)), sorted(cell(j) for j in (0, 5, 6, 7))]


def test_plan_is_pure_and_repeatable():
    m = manager(cfg())
    step = start(m, [Segment("a", 2), Segment(None, 0)], {"a": StreamPosition(3, 0)})
    state = m.slots.snapshot()
    p1, p2 = m.plan(step), m.plan(step)
    assert p1 == p2 and p1 is not p2
    assert m.slots.snapshot() == state


def test_planning_on_meta_device_never_touches_device_data():
    """On `meta` there is no data to read: any sync (.item(), .tolist(), .cpu()) would fail."""
    config = cfg()
    m = BoundedKVManager(config, "meta", block_size=8)
    assert m.k_cache_0.device.type == "meta"
    step = BoundedKVStep((Segment("a", 1), Segment(None, 0)), {"a": StreamPosition(0, 0)})
    m.admit(step)
    plan = m.plan(step)
    assert plan.kv_indices.device.type == "meta" and plan.n.device.type == "meta"
    ref = manager(config, full_blocks=True)  # meta plans as CUDA does: with full blocks
    ref.admit(step)
    assert plan == ref.plan(step)


def test_meta_plans_with_the_cuda_defaults():
    """A meta cache with nothing set plans as CUDA does: blocks of 128 and full blocks listed.

    Slot rows are 4 sink cells + a ring of 301 (slot 0 at cells 0-304, slot 1 at 305-609). "a"
    (n = 900, window from 600) reads its whole slot row 0-304: blocks 0 and 1 whole, block 2 in
    part. "b" (n = 41) reads sink cells 305-308 and ring cells 313-350 (stream 4..41): block 2 only.
    """
    config = cfg(max_source_len=0, max_sources=0, retention=SinkWindow(4, 300), max_step_tokens=1, max_slots=3)
    m = BoundedKVManager(config, "meta")
    assert m.layout.block_size == 128 and m.options.full_blocks
    step = start(m, [Segment("a", 1), Segment("b", 1)], {"a": StreamPosition(0, 900), "b": StreamPosition(0, 41)})
    plan = m.plan(step)
    assert plan.full_blocks
    assert (plan.blocks(0, full=True), plan.blocks(0)) == ([0, 1], [2])
    assert (plan.blocks(1, full=True), plan.blocks(1)) == ([], [2])
    assert plan.cell_intervals(0) == [(0, 305)] and plan.cell_intervals(1) == [(305, 309), (313, 351)]
    assert plan.write_cells(0) == [4 + 900 % 301] and plan.write_cells(1) == [309 + 41]


def test_blocks_every_query_reads_whole_skip_the_mask():
    """Window 16, no sink, T 1: ring of 17 cells (slot 0 at 0-16). At n=20 the row attends stream
    4..20, i.e. every cell 0-16: blocks 0 and 1 are full, block 2 (cell 16, then slot 1) is masked."""
    m = manager(cfg(max_source_len=0, max_sources=0, retention=SinkWindow(0, 16), max_step_tokens=1), full_blocks=True)
    step = start(m, [Segment("g", 1)], {"g": StreamPosition(0, 20)}, tokens=1)
    plan = m.plan(step)
    assert plan.blocks(0, full=True) == [0, 1]
    assert plan.blocks(0) == [2]
    assert open_cells(m, plan, 0) == [list(range(17))]
    # Early in the stream (n=5) slot 1 (cells 17-33) holds stream 0..5 at cells 17-22: block 2, masked.
    step = start(m, [Segment("h", 1)], {"h": StreamPosition(0, 5)}, tokens=1)
    plan = m.plan(step)
    assert m.slot_of("h") == 1
    assert (plan.blocks(0, full=True), plan.blocks(0)) == ([], [2])


def test_full_blocks_of_a_per_query_window_hold_what_every_query_reads():
    """query_window 9, T 2, no sink, ring 9 + 2 = 11 at cells 0-10 (blocks of 8), n = 30: query 30
    reads 21..30, query 31 reads 22..31; every query reads 22..30 (cells 0..8) -> block 0 is full."""
    config = cfg(max_source_len=0, max_sources=0, retention=SinkWindow(0, 9), query_window=9)
    m = manager(config, full_blocks=True)
    step = start(m, [Segment("q", 2)], {"q": StreamPosition(0, 30)}, tokens=2)
    plan = m.plan(step)
    cell = lambda j: j % 11
    assert plan.blocks(0, full=True) == [0]
    assert plan.blocks(0) == [1]
    assert open_cells(m, plan, 0) == [sorted(cell(j) for j in range(21, 31)), sorted(cell(j) for j in range(22, 32))]
    # Without full blocks (the CPU default) the same cells are all left to the mask.
    m = manager(config)
    step = start(m, [Segment("q", 2)], {"q": StreamPosition(0, 30)}, tokens=2)
    plan = m.plan(step)
    assert (plan.blocks(0, full=True), plan.blocks(0)) == ([], [0, 1])


def test_table_parts_lie_where_the_one_table_definition_puts_them():
    """Every part of a plan table is the span `PLAN_TABLE` gives it: the device views, the host
    readers and the planner's emit order agree, parts in order, nothing between or after them."""
    from flexkv.cache.host.planner import PLAN_TABLE, table_spans

    m = manager(cfg(max_slots=2))
    plan = m.plan(start(m, (Segment("a", 2), Segment(None, 0), Segment("b", 1)),
                        {"a": StreamPosition(2, 9), "b": StreamPosition(0, 3)}, tokens=2))
    spans = table_spans(plan.rows, plan.tokens, plan.width, plan.full_width)
    offsets = [spans[name][0] for name, _, _ in PLAN_TABLE]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert spans[None][0] == plan.table.numel() == len(plan.host) // 4
    base = plan.table.data_ptr()
    for name, _, _ in PLAN_TABLE:
        view = getattr(plan, name)
        assert (view.data_ptr() - base) // 4 == spans[name][0], name
        o, n, _ = spans[name]
        assert view.reshape(-1).tolist() == plan.table[o:o + plan.rows * n].tolist(), name
    for i in range(plan.rows):
        assert plan.row(i) == {k: int(getattr(plan, k)[i]) for k in plan.row(i)}
        assert plan.write_cells(i) == plan.write_index.view(plan.rows, plan.tokens)[i].tolist()
        assert plan.blocks(i) == plan.kv_indices[i, 0, 0, :int(plan.kv_num_blocks[i])].tolist()


def test_a_plan_for_eager_calls_makes_each_part_when_read_as_the_plan_with_parts_does():
    """`plan_eager(step)` makes no table part with the plan; each part read later is the
    same view of the table (offset, shape, strides, values) as the part a plan with its parts made
    holds, and `make_parts` makes the rest before a graph takes the plan in."""
    from flexkv.cache.host.planner import PLAN_TABLE

    m = manager(cfg(max_slots=2))
    # One token: a chunk's plan reads its parts at once (the rows path's geometry, `_plan_from`).
    step = start(m, (Segment("a", 1), Segment(None, 0), Segment("b", 1)),
                 {"a": StreamPosition(2, 9), "b": StreamPosition(0, 3)}, tokens=1)
    made, lazy = m.plan(step), m.plan_eager(step)
    assert made.parts_made and not lazy.parts_made
    assert made == lazy
    names = [name for name, _, _ in PLAN_TABLE]
    assert all(name in vars(made) for name in names) and not any(name in vars(lazy) for name in names)
    for name in names:
        a, b = getattr(made, name), getattr(lazy, name)
        assert (b.data_ptr() - lazy.table.data_ptr(), b.shape, b.stride()) == (
            a.data_ptr() - made.table.data_ptr(), a.shape, a.stride()), name
        assert torch.equal(a, b), name
    assert getattr(lazy, "write_index") is lazy.write_index  # made once, then kept
    lazy = m.plan_eager(step)
    first = lazy.kv_indices
    lazy.make_parts()
    assert lazy.parts_made and lazy.kv_indices is first and all(name in vars(lazy) for name in names)
    with pytest.raises(AttributeError, match="no attribute 'kv_index'"):
        lazy.kv_index
