"""The manager's lifecycle: errors, atomic admission, sources, memory, threads and request isolation."""

import random
import threading
from functools import partial

import pytest
import torch

from configs import small_config
from flexkv import (
    BoundedKVConfig,
    BoundedKVManager,
    BoundedKVStep,
    Segment,
    SinkWindow,
    SlotsExhausted,
    SourcesExhausted,
    StreamPosition,
)

config = partial(small_config, head_dim=4, rows_per_request=2, max_source_len=5, retention=SinkWindow(2, 4),
                 max_sources=2, min_source_len=1)


def source(c, length, fill=0.0, dtype=torch.float32):
    shape = (c.num_layers, c.rows_per_request, c.num_heads, length, c.head_dim)
    return torch.full(shape, fill, dtype=dtype), torch.full(shape, fill, dtype=dtype)


@pytest.fixture
def m():
    c = config()
    mgr = BoundedKVManager(c, "cpu", block_size=8)
    mgr.add_source(*source(c, 4))
    return mgr


def step(*segs, tokens=None, **pos):
    return BoundedKVStep(tuple(Segment(r, s) for r, s in segs), pos, tokens=tokens)


def snapshot(mgr):
    return mgr.slots.snapshot()


# ---------------------------------------------------------------- admit errors


@pytest.mark.parametrize(
    "bad, match",
    [
        (step(("a", 1), ("b", 1), a=StreamPosition(2, 0)), r"request 'b' has no StreamPosition"),
        (step(("a", 1), a=StreamPosition(2, 3)), r"request 'a': written=3 but 0 tokens are committed"),
        (step(("a", 1), a=StreamPosition(2, 0, source=1)), r"request 'a': unknown source 1; registered sources: \[0\]"),
        (step(("a", 1), a=StreamPosition(0, 0)), r"source_len=0 is outside \[min_source_len=1, max_source_len=5\]"),
        (step(("a", 1), a=StreamPosition(5, 0)), r"source_len=5 is longer than source 0 \(4 entries\)"),
        (step(("a", 4), tokens=3, a=StreamPosition(2, 0)), r"span=4 exceeds max_step_tokens=3"),
        (step(("a", 1), tokens=4, a=StreamPosition(2, 0)), r"T=4 must be an int in \[1, max_step_tokens=3\]"),
        (step(("a", 3), tokens=2, a=StreamPosition(2, 0)), r"span=3 exceeds the step's T=2"),
        (step(("a", -1), a=StreamPosition(2, 0)), r"span must be an int >= 0, got -1"),
        (step(("a", 1), ("a", 1), a=StreamPosition(2, 0)), r"request 'a' appears twice in one step"),
        (step(("a", 1), a=StreamPosition(2, -1)), r"written must be an int >= 0, got -1"),
        (BoundedKVStep((), {}), r"a step needs at least one segment"),
    ],
)
def test_bad_declarations_raise_and_change_nothing(m, bad, match):
    # One request already streams, so a failed admit has state to disturb.
    ok = step(("z", 2), z=StreamPosition(3, 0))
    m.admit(ok)
    m.commit(ok)
    before = snapshot(m)
    with pytest.raises(ValueError, match=match):
        m.admit(bad)
    assert snapshot(m) == before


def test_full_pool_raises_slots_exhausted_atomically(m):
    first = step(("a", 1), ("b", 1), a=StreamPosition(1, 0), b=StreamPosition(1, 0))
    m.admit(first)
    before = snapshot(m)
    with pytest.raises(SlotsExhausted, match=r"step needs 2 new slot\(s\) but only 1 of max_slots=3 are free"):
        m.admit(step(("c", 1), ("d", 1), c=StreamPosition(1, 0), d=StreamPosition(1, 0)))
    assert snapshot(m) == before and m.free_slots == 1
    # A later valid step in which "d" is padding still gets the free slot.
    m.admit(step(("c", 1), (None, 0), c=StreamPosition(1, 0)))
    assert m.free_slots == 0 and m.slot_of("c") == 2


def test_written_follows_commit_and_commit_is_idempotent(m):
    s0 = step(("a", 2), a=StreamPosition(2, 0))
    m.admit(s0)
    m.commit(s0)
    m.commit(s0)
    assert m.written("a") == 2
    with pytest.raises(ValueError, match=r"written=0 but 2 tokens are committed"):
        m.admit(s0)
    m.admit(step(("a", 1), a=StreamPosition(2, 2)))


def test_source_is_fixed_for_a_stream_until_reset(m):
    m.add_source(*source(m.config, 5))
    s0 = step(("a", 1), a=StreamPosition(2, 0))
    m.admit(s0)
    m.commit(s0)
    with pytest.raises(ValueError, match=r"stream started with source 0 \(source_len=2\) but this step declares source 1"):
        m.admit(step(("a", 1), a=StreamPosition(2, 1, source=1)))
    m.reset_request("a")
    assert m.written("a") == 0
    m.admit(step(("a", 1), a=StreamPosition(5, 0, source=1)))


def test_lifecycle_errors(m):
    with pytest.raises(ValueError, match=r"reset_request: request 'x' is not admitted"):
        m.reset_request("x")
    with pytest.raises(ValueError, match=r"remove_request: request 'x' is not admitted"):
        m.remove_request("x")
    with pytest.raises(ValueError, match=r"request 'x' is not admitted; call admit\(step\) before plan\(step\)"):
        m.plan(step(("x", 1), x=StreamPosition(1, 0)))
    with pytest.raises(ValueError, match=r"commit: request 'x' is not admitted"):
        m.commit(step(("x", 1), x=StreamPosition(1, 0)))


def test_remove_frees_the_slot_for_reuse(m):
    m.admit(step(("a", 1), ("b", 1), a=StreamPosition(1, 0), b=StreamPosition(1, 0)))
    slot = m.slot_of("a")
    m.remove_request("a")
    assert m.free_slots == 2
    m.admit(step(("c", 1), c=StreamPosition(1, 0)))
    assert m.slot_of("c") == slot


# -------------------------------------------------------------------- sources


@pytest.mark.parametrize("make, match", [
    (lambda k, v: (k[:, :1], v[:, :1]), r"keys shape expected \(2, 2, 2, 3, 4\), got \(2, 1, 2, 3, 4\)"),
    (lambda k, v: (k[0], v[0]), r"must be \[num_layers, rows_per_request, num_heads, L, head_dim\]"),
    (lambda k, v: (k.double(), v.double()), r"keys dtype expected torch.float32, got torch.float64"),
    (lambda k, v: (k, v[:, :, :, :2]), r"keys \(2, 2, 2, 3, 4\) and values \(2, 2, 2, 2, 4\) differ"),
], ids=["rows", "rank", "dtype", "lengths"])
def test_add_source_refuses_tensors_that_do_not_fit(m, make, match):
    k, v = source(m.config, 3)
    with pytest.raises(ValueError, match=match):
        m.add_source(*make(k, v))
    assert m.sources == {0: 4}


def test_add_source_refuses_a_source_longer_than_max_source_len(m):
    with pytest.raises(ValueError, match=r"source length 6 exceeds max_source_len=5"):
        m.add_source(*source(m.config, 6))


def test_add_source_takes_the_lowest_free_place_until_none_is_left(m):
    k, v = source(m.config, 3)
    assert m.add_source(k, v) == 1
    with pytest.raises(SourcesExhausted, match=r"all max_sources=2 source places are taken"):
        m.add_source(k, v)
    m.remove_source(0)
    assert m.add_source(k, v) == 0


def test_remove_source_is_refused_while_a_request_reads_it(m):
    idx = m.add_source(*source(m.config, 3))
    m.admit(step(("a", 1), a=StreamPosition(2, 0, source=idx)))
    with pytest.raises(ValueError, match=r"source 1 is still read by requests \['a'\]"):
        m.remove_source(idx)
    m.remove_request("a")
    m.remove_source(idx)
    with pytest.raises(ValueError, match=r"no source 1; registered: \[0\]"):
        m.remove_source(idx)


def test_source_is_read_where_it_lives(m):
    """Two requests on one source read its cells; no copy lands in their slots."""
    c = m.config
    k, v = source(c, 4, fill=0.0)
    v[:, :, :, :, 0] = 1.0
    idx = m.add_source(k, v)
    s = step(("a", 1), ("b", 1), a=StreamPosition(4, 0, source=idx), b=StreamPosition(2, 0, source=idx))
    m.admit(s)
    plan = m.plan(s)
    N = 4
    q = torch.zeros(N, 2, 1, 4)
    kk = torch.zeros(N, 2, 1, 4)
    vv = torch.zeros(N, 2, 1, 4)
    out = m.attend(0, q, kk, vv, plan)
    # Uniform weights: a reads sink 0, 1 and window 0..3 of the source -> 4 source entries + 1 own token.
    assert torch.allclose(out[0:2, :, 0, 0], torch.full((2, 2), 4 / 5))
    assert torch.allclose(out[2:4, :, 0, 0], torch.full((2, 2), 2 / 3))
    for rid in ("a", "b"):
        base = m.layout.slot_row(m.slot_of(rid), 0)
        assert m.v_cache_0[0, :, base:base + m.layout.slot_row_len, 0].abs().sum() == 0


# ---------------------------------------------------------------- attend errors


@pytest.fixture
def planned(m):
    """`m` with a step of T=2 for one request planned, and tensors that fit it."""
    s = step(("a", 2), a=StreamPosition(2, 0))
    m.admit(s)
    return m, m.plan(s), torch.zeros(2, 4, 2, 4), torch.zeros(2, 2, 2, 4)


@pytest.mark.parametrize("call, match", [
    (lambda m, p, q, kv: m.attend(0, q, torch.zeros(2, 2, 3, 4), kv, p),
     r"k shape expected \(2, 2, 2, 4\) .*got \(2, 2, 3, 4\); the plan was made for T=2"),
    (lambda m, p, q, kv: m.attend(0, torch.zeros(2, 3, 2, 4), kv, kv, p),
     r"q shape expected \(2, a multiple of num_heads=2, 2, 4\), got \(2, 3, 2, 4\)"),
    (lambda m, p, q, kv: m.attend(0, q.half(), kv, kv, p), r"q dtype expected torch.float32, got torch.float16"),
    (lambda m, p, q, kv: m.attend(0, q, kv, kv.to("meta"), p), r"v device expected cpu, got meta"),
    (lambda m, p, q, kv: m.attend(2, q, kv, kv, p), r"layer_idx must be an int in \[0, 2\), got 2"),
    (lambda m, p, q, kv: m.attend(0, torch.zeros(2, 4, 4, 4), kv, kv, p), r"T=4 exceeds max_step_tokens=3"),
    (lambda m, p, q, kv: m.attend(0, q, kv, kv, p, positions="cells"), r"positions must be one of"),
    (lambda m, p, q, kv: m.attend(0, q, kv, kv, None), r"attend needs this cache's plan: .*got NoneType"),
], ids=["k-tokens", "q-heads", "dtype", "device", "layer", "too-many-tokens", "positions", "no-plan"])
def test_attend_refuses_what_does_not_fit_the_plan(planned, call, match):
    m, plan, q, kv = planned
    with pytest.raises(ValueError, match=match):
        call(m, plan, q, kv)


# --------------------------------------------------------------------- memory


def test_memory_bytes_counts_every_cell_of_every_layer():
    c = config(dtype=torch.float16)
    mgr = BoundedKVManager(c, "cpu", block_size=8)
    # Cells per layer: sources 2*2*5 = 20, slots 3 * 2 * (sink 1 + window 4 + step 3) = 48, scratch 3 -> 71 -> 72.
    assert c.sink_capacity == 1 and mgr.layout.total_len == 72
    per_cell = 2 * c.num_layers * c.num_heads * c.head_dim * 2  # K and V, fp16
    assert mgr.memory_bytes == 72 * per_cell
    assert mgr.slot_bytes == 2 * 8 * per_cell
    assert mgr.slot_bytes * c.max_slots <= mgr.memory_bytes


def test_memory_is_fixed_while_streams_advance():
    c = config(min_source_len=0)
    mgr = BoundedKVManager(c, "cpu", block_size=8)
    before = mgr.memory_bytes
    ptrs = [b.data_ptr() for b in mgr.store.cell_buffers()]
    for w in range(0, 30, 3):
        s = step(("a", 3), a=StreamPosition(0, w))
        mgr.admit(s)
        p = mgr.plan(s)
        mgr.attend(0, torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4), p)
        mgr.commit(s)
    assert mgr.memory_bytes == before
    assert [b.data_ptr() for b in mgr.store.cell_buffers()] == ptrs


# -------------------------------------------------------------------- threads


def test_pool_is_safe_under_threads():
    c = config(max_slots=8, min_source_len=0)
    mgr = BoundedKVManager(c, "meta", block_size=8)
    errors = []

    def worker(tid):
        rng = random.Random(tid)
        try:
            for i in range(200):
                rid = (tid, i)
                s = BoundedKVStep((Segment(rid, 1),), {rid: StreamPosition(0, 0)})
                try:
                    mgr.admit(s)
                except SlotsExhausted:
                    continue
                mgr.commit(s)
                assert mgr.written(rid) == 1
                if rng.random() < 0.5:
                    mgr.reset_request(rid)
                mgr.remove_request(rid)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert mgr.free_slots == c.max_slots and mgr.slots.snapshot()[1] == tuple(range(c.max_slots))
    assert mgr.requests == ()


# ------------------------------------------------------------------ isolation


def test_no_request_reads_another_requests_entries():
    """One-hot values per (request, stream generation) and zero queries: every output is a
    uniform average over what the row attends, so any foreign entry shows up as mass on its
    channel. Requests come and go, reset and reuse slots, so stale cells are everywhere."""
    c = BoundedKVConfig(num_layers=1, num_heads=1, head_dim=128, rows_per_request=2, max_source_len=3,
                        retention=SinkWindow(2, 3), max_slots=3, max_step_tokens=2, max_sources=2)
    mgr = BoundedKVManager(c, "cpu", block_size=8)
    rng = random.Random(0)
    for s_idx in range(2):
        k = torch.zeros(1, 2, 1, 3, 128)
        v = torch.zeros(1, 2, 1, 3, 128)
        v[..., 126 + s_idx] = 1.0  # channels 126, 127: the sources
        mgr.add_source(k, v)
    channel = {}
    live = {}  # rid -> [source, source_len, written]
    next_channel = 0
    for it in range(60):
        for rid in list(live):
            r = rng.random()
            if r < 0.1:
                mgr.remove_request(rid)
                del live[rid]
            elif r < 0.2:
                mgr.reset_request(rid)
                live[rid][2] = 0
                channel[rid] = next_channel
                next_channel += 1
        while len(live) < 3:
            rid = f"r{it}-{len(live)}"
            live[rid] = [rng.randint(0, 1), rng.randint(0, 3), 0]
            channel[rid] = next_channel
            next_channel += 1
        rids = sorted(live)
        s = BoundedKVStep(
            tuple(Segment(r, rng.randint(0, 2)) for r in rids),
            {r: StreamPosition(live[r][1], live[r][2], source=live[r][0]) for r in rids},
            tokens=2,
        )
        mgr.admit(s)
        plan = mgr.plan(s)
        N = 2 * len(rids)
        v = torch.zeros(N, 1, 2, 128)
        for i, r in enumerate(rids):
            v[2 * i:2 * i + 2, :, :, channel[r]] = 1.0
        out = mgr.attend(0, torch.zeros(N, 1, 2, 128), torch.zeros(N, 1, 2, 128), v, plan)
        for i, r in enumerate(rids):
            allowed = torch.zeros(128, dtype=torch.bool)
            allowed[channel[r]] = True
            if live[r][1]:
                allowed[126 + live[r][0]] = True
            rows = out[2 * i:2 * i + 2]
            assert rows[..., ~allowed].abs().max() == 0, (it, r)
            assert torch.allclose(rows.sum(-1), torch.ones_like(rows.sum(-1)))
        mgr.commit(s)
        for seg in s.segments:
            live[seg.request_id][2] += seg.span
        assert next_channel < 126


def test_a_padding_segment_is_refused_by_a_cache_built_without_scratch_and_changes_nothing():
    """`padding_segments=False` keeps no cells for padding rows to write into: a step with one is refused by name
    before anything is admitted, and the same step without the padding row then runs."""
    cfg = BoundedKVConfig(num_layers=1, num_heads=1, head_dim=4, rows_per_request=1, max_source_len=0, max_sources=0,
                          retention=SinkWindow(1, 4), max_slots=2, max_step_tokens=2, padding_segments=False)
    m = BoundedKVManager(cfg, "cpu")
    padded = BoundedKVStep((Segment("a", 1), Segment(None, 0)), {"a": StreamPosition(0, 0)}, tokens=1)
    with pytest.raises(ValueError, match=r"padding segment .* padding_segments=False .* padding_segments=True"):
        m.admit(padded)
    assert m.free_slots == 2 and m.requests == ()
    step = BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(0, 0)}, tokens=1)
    m.admit(step)
    plan = m.plan(step)
    q, k, v = (torch.randn(1, 1, 1, 4) for _ in range(3))
    assert torch.allclose(m.attend(0, q, k, v, plan), v)  # the one key it has is its own
    m.commit(step)
    with pytest.raises(ValueError, match="padding_segments must be a bool, got 0"):
        cfg.replace(padding_segments=0)
