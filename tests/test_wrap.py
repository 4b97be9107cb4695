"""The drop-in attention cores: the bounded one computes what the uncached one does."""

from functools import partial

import pytest
import torch
from random_workload import check_close

from configs import small_config
from flexkv import BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cache.positions.rotary import Rotary
from flexkv.model.step_context import StepContext
from flexkv.model.uncached import UncachedHistory
from flexkv.model.wrap import CacheAttention, attention
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

H, HQ, D, R = 2, 4, 8, 2


_config = partial(small_config, rows_per_request=R, max_sources=1, retention=SinkWindow(3, 5), max_step_tokens=2)


def test_bounded_matches_uncached_with_rotary_cache_positions_and_multi_token_steps():
    """Per-step window, T=2, rotary at in-cache positions, a padding row, a late joiner."""
    torch.manual_seed(0)
    cfg = _config()
    rot = Rotary(D, base=30.0)
    contexts = [StepContext(BoundedKVManager(cfg, block_size=16)), StepContext(UncachedHistory(cfg))]
    cores = [[attention(ctx, i, rotary=rot, rope_positions="cache") for i in range(2)] for ctx in contexts]
    written = {"a": 0, "b": 0}
    for s in range(14):
        segs = (Segment("a", 2), Segment("b", 1) if s >= 3 else Segment(None, 0))
        step = BoundedKVStep(segs, {rid: StreamPosition(0, w) for rid, w in written.items()
                                    if rid == "a" or s >= 3}, tokens=2)
        qkv = [(torch.randn(2 * R, HQ, 2, D), torch.randn(2 * R, H, 2, D), torch.randn(2 * R, H, 2, D))
               for _ in range(2)]
        outs = []
        for ctx, layers in zip(contexts, cores):
            ctx.bind(ctx.begin(step))
            outs.append([layer(*qkv[i]) for i, layer in enumerate(layers)])
            ctx.commit()
        for layer, (got, exp) in enumerate(zip(*outs)):
            live = slice(0, 2 * R) if s >= 3 else slice(0, R)
            check_close(got[live], exp[live], 2e-5, f"step {s}, layer {layer}")
        written["a"] += 2
        if s >= 3:
            written["b"] += 1
    assert written["a"] > 3 * (3 + 5)


def test_context_and_core_errors():
    cfg = _config()
    m = BoundedKVManager(cfg, block_size=16)
    with pytest.raises(ValueError, match="StepContext: the cache must be a flexkv cache .* BoundedKVConfig lacks"):
        StepContext(cfg)
    ctx = StepContext(m)
    with pytest.raises(ValueError, match="no step was begun"):
        ctx.commit()
    with pytest.raises(ValueError, match=r"layer_idx must be an int in \[0, 2\)"):
        CacheAttention(ctx, 2)
    with pytest.raises(ValueError, match="rope_positions must be one of"):
        CacheAttention(ctx, 0, rotary=Rotary(D), rope_positions="absolute")
    # the cache-position check runs in begin(), before anything is planned
    qctx = StepContext(BoundedKVManager(_config(query_window=5), block_size=16))
    rope_core = CacheAttention(qctx, 0, rotary=Rotary(D), rope_positions="cache")
    q, kv = torch.zeros(R, HQ, 2, D), torch.zeros(R, H, 2, D)
    for n in range(0, 8, 2):  # the last query is at n + 1 <= query_window + sink = 8: one eviction count
        qctx.begin(BoundedKVStep((Segment("a", 2),), {"a": StreamPosition(0, n)}))
        rope_core(q, kv, kv)
        qctx.attend(1, q, kv, kv)
        qctx.commit()
    with pytest.raises(ValueError, match="one eviction count per step"):
        qctx.begin(BoundedKVStep((Segment("a", 2),), {"a": StreamPosition(0, 8)}))


def test_stream_offsets_are_each_rows_first_stream_index():
    """`stream_offsets()` `[N]`: a RoPE that takes one offset per row and adds arange(T) itself gets the
    positions `stream_positions()` gives, on chunks at different stream lengths, a padding row included."""
    cfg = _config(max_step_tokens=3)
    for cache in (BoundedKVManager(cfg, block_size=16), UncachedHistory(cfg)):
        ctx = StepContext(cache)
        written = {"a": 0, "b": 0}
        for s in range(4):
            segs = (Segment("a", 3), Segment(None, 0), Segment("b", 1))
            ctx.bind(ctx.begin(BoundedKVStep(segs, {r: StreamPosition(0, w) for r, w in written.items()}, tokens=3)))
            offsets, positions = ctx.stream_offsets(), ctx.stream_positions()
            assert offsets.shape == (3 * R,)
            assert torch.equal(offsets[:, None] + torch.arange(3), positions)
            assert offsets.view(3, R)[:, 0].tolist() == [written["a"], 0, written["b"]]
            q, kv = torch.zeros(3 * R, HQ, 3, D), torch.zeros(3 * R, H, 3, D)
            core = attention(ctx, 0)
            assert torch.equal(core.stream_offsets(), offsets)
            core(q, kv, kv)
            ctx.attend(1, q, kv, kv)
            ctx.commit()
            written["a"] += 3
            written["b"] += 1
    rev = StepContext(BoundedKVManager(_config(reverse_step_order=True), block_size=16))
    rev.begin(BoundedKVStep((Segment("a", 2),), {"a": StreamPosition(0, 0)}, tokens=2))
    with pytest.raises(ValueError, match=r"reverse_step_order=True .* count down.*use stream_positions\(\)"):
        rev.stream_offsets()


def test_the_core_attends_through_its_context():
    """`CacheAttention` is one more caller of `StepContext.attend` (the one place a layer's call is counted for
    the attendance check and handed to the cache), with its scale and score_mod passed on."""
    ctx = StepContext(BoundedKVManager(_config(), block_size=16))
    calls = []
    attend = ctx.attend
    ctx.attend = lambda layer, q, k, v, **kw: (calls.append((layer, sorted(kw))), attend(layer, q, k, v, **kw))[1]
    core = attention(ctx, 1, scale=0.5)
    with ctx.stepping(BoundedKVStep((Segment("a", 2),), {"a": StreamPosition(0, 0)}, tokens=2)):
        q, kv = torch.randn(R, HQ, 2, D), torch.randn(R, H, 2, D)
        out = core(q, kv, kv)
        ctx.attend(0, q, kv, kv)
    assert calls == [(1, ["positions", "scale", "score_mod"]), (0, [])]
    assert ctx.attendance.counts == [1, 1]
    want = StepContext(BoundedKVManager(_config(), block_size=16))
    with want.stepping(BoundedKVStep((Segment("a", 2),), {"a": StreamPosition(0, 0)}, tokens=2)):
        want(0, q, kv, kv)
        torch.testing.assert_close(out, want(1, q, kv, kv, scale=0.5), rtol=0, atol=0)
