"""The rows path's one-token geometry laid out from the plan's host intervals equals the one built by
evaluating the retention mask on every cell (`row_attention.mask_geometry`)."""

from __future__ import annotations

import random

import pytest
import torch

from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cache.cpu.cpu_fast_rows import one_token_in_place
from flexkv.cache.paths.row_attention import mask_geometry, reads_in_place
from flexkv.cache.positions.masks import store_mask_mod


@pytest.mark.parametrize("query_window", [None, "window"])
@pytest.mark.parametrize("sink, window, slots, chunk", [(4, 8, 1, 8), (0, 5, 2, 3), (2, 6, 3, 4), (3, 1, 2, 1)])
def test_one_token_geometry_from_host_intervals_equals_the_masked_one(query_window, sink, window, slots, chunk):
    cfg = BoundedKVConfig(num_layers=1, num_heads=2, head_dim=8, rows_per_request=1, max_source_len=0,
                          max_sources=0, retention=SinkWindow(sink, window), max_slots=slots, max_step_tokens=chunk,
                          query_window=window if query_window else None)
    m = BoundedKVManager(cfg, block_size=16)
    rng = random.Random(sink * 100 + window * 10 + slots)
    written = {}
    checked = identities = all_read = 0
    for _ in range(60):
        # A random batch of the live streams and new ones (and a padding row now and then), one token each
        # after a random-length first step.
        sids = [s for s in range(slots) if rng.random() < 0.8] or [0]
        first = [s for s in sids if s not in written]
        T = 1 if not first else rng.randint(1, chunk)
        segs = [Segment(s, T if s in first else 1) for s in sids]
        if rng.random() < 0.3:
            segs.insert(rng.randrange(len(segs) + 1), Segment(None, 0))
        step = BoundedKVStep(tuple(segs), {s: StreamPosition(0, written.get(s, 0)) for s in sids}, tokens=T)
        m.admit(step)
        plan = m.plan(step)
        lay = m.layout
        if T == 1 and reads_in_place(lay, plan.rows):
            for group in (1, 2):
                mask_mod = store_mask_mod(m.store, plan, 1, group > 1)
                want = mask_geometry(lay, plan, mask_mod, group, torch.float32)
                got = one_token_in_place(lay, plan, group, torch.float32, m.store.memos)
                # The host flags say what the device geometry holds (the masked one, built on the device,
                # knows neither and says False).
                assert not want.identity and not want.all_read
                if got.identity:
                    assert all(torch.equal(t, torch.arange(plan.rows)) for t in (want.batch_rows, want.to_batch,
                                                                                 want.back))
                    identities += 1
                if got.all_read:
                    assert bool(want.reads.all()) and bool(want.row_reads.all())
                    all_read += 1
                else:
                    assert not (bool(want.reads.all()) and bool(want.row_reads.all()))
                assert got.identity == (plan.rows == len(want.batch_rows)
                                        and torch.equal(want.to_batch, torch.arange(plan.rows)))
                for name in want._fields:
                    if name in ("identity", "all_read"):
                        continue
                    a, b = getattr(got, name), getattr(want, name)
                    if isinstance(b, torch.Tensor):  # (a per-step window's mask has one query row, broadcast)
                        assert a.dim() == b.dim() and torch.equal(*torch.broadcast_tensors(a, b)), (name, a, b)
                    else:
                        assert a == b, name
                checked += 1
        m.commit(step)
        for s in sids:
            written[s] = written.get(s, 0) + (T if s in first else 1)
        if rng.random() < 0.1 and len(written) > 0:  # end a stream: its slot is reused
            gone = rng.choice(sorted(written))
            m.remove_request(gone)
            del written[gone]
    assert checked > 20
    if slots == 1:  # one stream decoding alone: the shortcut the flags allow is taken
        assert identities > 0 and all_read > 0


def test_a_stream_past_its_window_reuses_its_one_token_geometry_and_a_new_reach_builds_one():
    """Sink 2 + window 4: once the ring is full the one token reads the whole slot row every step, so
    the geometry of the step before is returned again; early in the stream each step reads one more
    cell, and gets a geometry of its own (each equal to the mask evaluated on every cell)."""
    cfg = BoundedKVConfig(num_layers=1, num_heads=2, head_dim=8, rows_per_request=1, max_source_len=0,
                          max_sources=0, retention=SinkWindow(2, 4), max_slots=1, max_step_tokens=1)
    m = BoundedKVManager(cfg, block_size=16)
    last, same = None, []
    for n in range(14):
        step = BoundedKVStep((Segment("s", 1),), {"s": StreamPosition(0, n)})
        m.admit(step)
        plan = m.plan(step)
        got = one_token_in_place(m.layout, plan, 1, torch.float32, m.store.memos)
        want = mask_geometry(m.layout, plan, store_mask_mod(m.store, plan, 1, False), 1, torch.float32)
        assert torch.equal(*torch.broadcast_tensors(got.bias, want.bias))
        same.append(got is last)
        last = got
        m.commit(step)
    # n = 0..5 reach one more cell each (and n = 6 the last ring cell: 2 + 4 + 1 cells in all).
    assert same == [False] * 7 + [True] * 7
