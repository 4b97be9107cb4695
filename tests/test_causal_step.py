"""A per-step window that is causal inside the step (`causal_step=True`), through every door.

The property tests (tests/test_properties.py) and the block lists
(tests/test_block_lists.py) draw it among every other retention; here it is
checked where it meets the rest: a layer group of its own, the session (which
may then pad feeds at the end), the uncached twin and rotary in-cache
positions. The oracle is `flexkv.model.reference`, one `ReferenceCache` per layer.
"""

import random

import pytest
import torch
from random_workload import check_close

from flexkv import (
    BoundedKVConfig,
    BoundedKVManager,
    BoundedKVStep,
    LayerGroup,
    Segment,
    SinkWindow,
    StreamPosition,
    StreamSession,
)
from flexkv.cache.groups import per_layer_groups
from flexkv.cache.paths.attention_options import AttentionOptions
from flexkv.cache.positions.rotary import Rotary
from flexkv.model.reference import ReferenceCache
from flexkv.model.step_context import StepContext
from flexkv.model.uncached import UncachedHistory
from flexkv.model.wrap import attention
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

H, HQ, D, T = 2, 4, 8, 3


def config(**kw):
    base = dict(num_layers=2, num_heads=H, head_dim=D, rows_per_request=1, max_source_len=0, max_sources=0,
                retention=SinkWindow.keys(5, sink=1), causal_step=True, max_slots=3, max_step_tokens=T)
    base.update(kw)
    return BoundedKVConfig(**base)


GROUPS = (
    LayerGroup((0,), SinkWindow.keys(4), causal_step=True, name="ring"),
    LayerGroup((1,), SinkWindow(1, 6), name="chunk"),
)


@pytest.mark.parametrize("path", ["auto", "flex"])
def test_a_causal_group_next_to_a_per_step_group_matches_the_reference(path):
    cfg = config()
    options = AttentionOptions.for_cache(cfg, "cpu", path=path)
    cache = BoundedKVManager(cfg, groups=GROUPS, block_size=8, options=options)
    refs = [ReferenceCache(cfg.replace(num_layers=1, retention=g.retention, causal_step=g.causal_step))
            for g in GROUPS]
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    written = {"a": 0, "b": 0}
    for s in range(14):
        t = rng.randint(1, T)
        spans = {rid: rng.choice([t, t, rng.randint(0, t)]) for rid in written}
        step = BoundedKVStep((Segment("a", spans["a"]), Segment(None, 0), Segment("b", spans["b"])),
                             {rid: StreamPosition(0, w) for rid, w in written.items()}, tokens=t)
        cache.admit(step)
        plan = cache.plan(step)
        for layer in range(2):
            q = torch.randn(3, HQ, t, D, generator=gen)
            k, v = torch.randn(3, H, t, D, generator=gen), torch.randn(3, H, t, D, generator=gen)
            got = cache.attend(layer, q, k, v, plan)
            want = refs[layer].attend(0, q, k, v, step)
            for row, rid in enumerate(("a", None, "b")):  # one row per segment
                check_close(got[row], want[row], 1e-5, f"step {s} (T={t}), layer {layer}, "
                            + ("the padding segment" if rid is None else f"request {rid!r}"))
        cache.commit(step)
        for ref in refs:
            ref.commit(step)
        for rid in written:
            written[rid] += spans[rid]
    assert min(written.values()) > 6  # past both windows


def test_causal_step_groups_per_layer():
    groups = per_layer_groups([SinkWindow.keys(4), SinkWindow(1, 6), SinkWindow.keys(4)], None, [True, False, True])
    assert [(g.layers, g.causal_step) for g in groups] == [((0, 2), True), ((1,), False)]
    with pytest.raises(ValueError, match="causal_step names 2 layers but retention names 3"):
        per_layer_groups([SinkWindow(0, 2)] * 3, None, [True, False])
    with pytest.raises(ValueError, match="LayerGroup.causal_step must be a bool"):
        LayerGroup((0,), SinkWindow(0, 2), causal_step="yes")
    with pytest.raises(ValueError, match=r"group 0 \(layers \[0\]\): causal_step=True is a per-step window"):
        BoundedKVManager(config(), "meta", groups=(LayerGroup((0,), SinkWindow(0, 4), 2, causal_step=True),
                                    LayerGroup((1,), SinkWindow(0, 4))))


def _attention_model(attn, x):
    """`x [B, T, 3, HQ, D]` -> every layer's attention output `[B, T, 2, HQ, D]`."""
    outs = []
    for layer in range(2):
        y = x * (layer + 1)
        q, k, v = y[:, :, 0].transpose(1, 2), y[:, :, 1, :H].transpose(1, 2), y[:, :, 2, :H].transpose(1, 2)
        outs.append(attn(layer, q, k, v).transpose(1, 2))
    return torch.stack(outs, dim=2)


@pytest.mark.parametrize("make", [
    lambda cfg: StreamSession(cfg, compile=False, block_size=8),
    lambda cfg: StreamSession(UncachedHistory(cfg), compile=False),
], ids=["bounded", "uncached"])
def test_session_pads_short_feeds_for_causal_layers(make):
    """Feeds of 1..T tokens in one step: the padding after a short feed is never attended."""
    cfg = config()
    session = make(cfg)
    ref = ReferenceCache(cfg)
    gen = torch.Generator().manual_seed(1)
    schedule = [{"a": 3, "b": 1}, {"a": 2, "b": 3}, {"a": 1, "b": 1}, {"a": 3, "b": 2}] * 3
    for s, lengths in enumerate(schedule):
        feeds = {rid: torch.randn(n, 3, HQ, D, generator=gen) for rid, n in lengths.items()}
        res = session.step(feeds, _attention_model)
        B, t = len(res.step.segments), res.step.step_tokens
        assert t == max(lengths.values())
        x = torch.zeros(B, t, 3, HQ, D)
        for rid, lane in res.lanes.items():
            x[lane, :lengths[rid]] = feeds[rid]
        for layer in range(2):
            y = x * (layer + 1)
            q, k, v = y[:, :, 0].transpose(1, 2), y[:, :, 1, :H].transpose(1, 2), y[:, :, 2, :H].transpose(1, 2)
            want = ref.attend(layer, q, k, v, res.step).transpose(1, 2)
            for rid, lane in res.lanes.items():
                n = lengths[rid]
                check_close(res[rid][:, layer], want[lane, :n], 1e-5, f"step {s}, layer {layer}, request {rid!r}")
        ref.commit(res.step)
    assert session.written("a") == sum(feeds["a"] for feeds in schedule)


def test_session_still_refuses_short_feeds_for_a_non_causal_per_step_window():
    session = StreamSession(config(causal_step=False, retention=SinkWindow(1, 5, window_includes_step=True)),
                            compile=False, block_size=8)
    x = torch.zeros(1, 3, HQ, D)
    with pytest.raises(ValueError, match="feeds 1 tokens in a step of T=3; with a per-step window"):
        session.step({"a": x.expand(3, -1, -1, -1), "b": x}, _attention_model)


def test_rotary_cache_positions_on_causal_chunks_match_the_twin():
    """StreamingLLM's in-cache positions served in O(sink) on causal chunks, against the twin that
    re-rotates every attended key at its in-cache position."""
    cfg = config(num_layers=1, retention=SinkWindow.keys(6, sink=2))
    rot = Rotary(D, base=50.0, layout="interleaved")
    contexts = [StepContext(BoundedKVManager(cfg, block_size=8)), StepContext(UncachedHistory(cfg))]
    cores = [attention(ctx, 0, rotary=rot, rope_positions="cache") for ctx in contexts]
    gen = torch.Generator().manual_seed(2)
    written = 0
    for _ in range(9):
        step = BoundedKVStep((Segment(None, 0), Segment("a", T)), {"a": StreamPosition(0, written)}, tokens=T)
        q, k, v = (torch.randn(2, h, T, D, generator=gen) for h in (HQ, H, H))
        outs = []
        for ctx, core in zip(contexts, cores):
            ctx.bind(ctx.begin(step))
            outs.append(core(q, k, v))
            ctx.commit()
        torch.testing.assert_close(outs[0][1:], outs[1][1:], rtol=0, atol=1e-5)
        written += T
    # Both caches committed every chunk, far past sinks + window: in-cache positions had shifted.
    assert [ctx.cache.written("a") for ctx in contexts] == [written, written] and written > 2 + 6 + T
