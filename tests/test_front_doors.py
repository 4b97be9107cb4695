"""Every front door serves every retention the core has.

`StreamSession`, `flexkv.model.wrap` and the engine seam use a cache only through
the cache protocol (`flexkv.cache.protocol.StreamCache`), so a model whose layers
keep different parts of the stream (a `BoundedKVManager` with layer groups, or its uncached
twin) runs through each of them. The oracle is one `ReferenceCache` per
layer, built with that layer's own retention: it shares no code with the
groups or the session. The twin attends through `ReferenceCache` itself, so
its cases check the plumbing (grouping, routing, lifecycle through the
protocol), not the attention.
"""

from functools import partial

import pytest
import torch
import torch._dynamo
from random_workload import check_close
from torch._dynamo.utils import counters

from configs import small_config
from flexkv import BoundedKVManager, BoundedKVStep, LayerGroup, Segment, SinkWindow, StreamPosition, StreamSession
from flexkv.cache.positions.rotary import Rotary
from flexkv.cache.protocol import StreamCache, check_cache
from flexkv.cache.storage.quantized import round_trip
from flexkv.model.reference import ReferenceCache
from flexkv.model.step_context import StepContext
from flexkv.model.uncached import UncachedHistory
from flexkv.model.wrap import attention
from flexkv.serving import BoundedKVResource, BoundedKVSpec, EngineResourceInfo
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

H, HQ, D, LAYERS = 2, 4, 8, 3

GROUPS = (
    LayerGroup((0, 2), SinkWindow(0, 3), query_window=3, name="local"),
    LayerGroup((1,), SinkWindow(2, 6), query_window=6, name="global"),
)


config = partial(small_config, num_layers=LAYERS, num_heads=H, head_dim=D, query_window=3)


class LayerReference:
    """One `ReferenceCache` per layer, each with its layer's group retention."""

    def __init__(self, cfg, groups):
        self.slot_dtype = cfg.slot_dtype  # quantized slots: the reference runs on the dequantized cells
        by_layer = {layer: g for g in groups for layer in g.layers}
        self.refs = [ReferenceCache(cfg.replace(num_layers=1, retention=by_layer[i].retention,
                                                query_window=by_layer[i].query_window)) for i in range(cfg.num_layers)]

    def attend(self, layer, q, k, v, step):
        return self.refs[layer].attend(0, q, round_trip(k, self.slot_dtype), round_trip(v, self.slot_dtype), step)

    def commit(self, step):
        for ref in self.refs:
            ref.commit(step)

    def remove(self, rid):
        for ref in self.refs:
            ref.remove_request(rid)


def split(x, layer):
    """`x [B, T, 3, HQ, D]` -> q `[B, HQ, T, D]`, k, v `[B, H, T, D]`, scaled per layer so layers differ."""
    x = x * (layer + 1)
    return x[:, :, 0].transpose(1, 2), x[:, :, 1, :H].transpose(1, 2), x[:, :, 2, :H].transpose(1, 2)


def model(attn, x):
    """Attention only: every layer's output, `[B, T, LAYERS, HQ, D]`."""
    return torch.stack([attn(layer, *split(x, layer)).transpose(1, 2) for layer in range(LAYERS)], dim=2)


def feed(n, seed):
    return torch.randn(n, 3, HQ, D, generator=torch.Generator().manual_seed(seed))


SCHEDULE = (
    # (feeds as {request: tokens}, request to finish after the step)
    [({"a": 3, "b": 1}, None), ({"a": 2, "b": 1}, None), ({"a": 1, "b": 3, "c": 1}, None)]
    + [({"a": 1, "b": 1, "c": 2}, None)] * 5
    + [({"a": 1, "b": 1, "c": 1}, "b")]
    + [({"a": 1, "c": 1, "d": 3}, None)] * 4
)


def run_schedule(session, ref, tolerance=1e-5):
    """Stream `SCHEDULE` through `session` and `ref`; the first step, layer and request further than
    `tolerance` from `ref` fails there."""
    seed = 0
    for s, (feeds_n, finish) in enumerate(SCHEDULE):
        feeds = {}
        for rid, n in feeds_n.items():
            feeds[rid] = feed(n, seed)
            seed += 1
        res = session.step(feeds, model)
        B, T = len(res.step.segments), res.step.step_tokens
        x = torch.zeros(B, T, 3, HQ, D)
        for rid, lane in res.lanes.items():
            x[lane, :res.tokens[rid]] = feeds[rid]
        for layer in range(LAYERS):
            q, k, v = split(x, layer)
            want = ref.attend(layer, q, k, v, res.step).transpose(1, 2)
            for rid, lane in res.lanes.items():
                check_close(res[rid][:, layer], want[lane, :res.tokens[rid]], tolerance,
                            f"step {s}, layer {layer}, request {rid!r} (lane {lane})")
        ref.commit(res.step)
        if finish is not None:
            session.finish(finish)
            ref.remove(finish)


@pytest.mark.parametrize("cache", [
    lambda cfg: BoundedKVManager(cfg, block_size=8),
    lambda cfg: BoundedKVManager(cfg, groups=GROUPS, block_size=8),
    lambda cfg: UncachedHistory(cfg),
    lambda cfg: UncachedHistory(cfg, GROUPS),
], ids=["bounded", "grouped", "uncached", "uncached-grouped"])
def test_every_cache_meets_the_protocol(cache):
    c = cache(config())
    assert isinstance(c, StreamCache)
    assert check_cache(c, "here") is c


def test_a_config_is_not_a_cache_and_the_error_says_what_is_missing():
    with pytest.raises(ValueError, match=r"here: the cache must be a flexkv cache .* BoundedKVConfig lacks .*admit"):
        check_cache(config(), "here")


@pytest.mark.parametrize("make", [
    lambda cfg: StreamSession(BoundedKVManager(cfg, groups=GROUPS, block_size=8), compile=False),
    lambda cfg: StreamSession(UncachedHistory(cfg, GROUPS), compile=False),
    lambda cfg: StreamSession(cfg, groups=GROUPS, compile=False, block_size=8),
], ids=["grouped", "uncached-grouped", "config-and-groups"])
def test_session_attends_each_layer_by_its_groups_retention(make):
    cfg = config()
    run_schedule(make(cfg), LayerReference(cfg, GROUPS))


@pytest.mark.parametrize("slot_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("make", [
    lambda cfg: StreamSession(cfg, groups=GROUPS, compile=False, block_size=8),
    lambda cfg: StreamSession(UncachedHistory(cfg, GROUPS), compile=False),
], ids=["grouped", "uncached-grouped"])
def test_quantized_slots_through_the_session_and_its_twin(make, slot_dtype):
    """A session over a grouped cache with quantized slots (and over its uncached twin) computes the
    per-layer reference on the dequantized cells; on the raw inputs it would be off by far more."""
    cfg = config(slot_dtype=slot_dtype)
    run_schedule(make(cfg), LayerReference(cfg, GROUPS))
    with pytest.raises(AssertionError, match=r"step \d+, layer \d+, request .*> 0.001"):
        run_schedule(make(cfg), LayerReference(config(), GROUPS), tolerance=1e-3)


def test_compiled_session_with_quantized_slots_compiles_once_and_matches_the_reference():
    cfg = config(slot_dtype=torch.int8)
    session = StreamSession(cfg, groups=GROUPS, token_sizes=(1, 3), block_size=8)
    assert all(m.k_cache_0.dtype == torch.int8 for m in session.cache.cache_groups)
    torch._dynamo.reset()
    counters.clear()
    session.warmup(model, feed(1, 0))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2
    with torch._dynamo.config.patch(error_on_recompile=True):
        run_schedule(session, LayerReference(cfg, GROUPS), tolerance=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs


def test_wrap_on_a_quantized_grouped_cache_computes_what_the_quantized_twin_computes():
    cfg = config(query_window=None, slot_dtype=torch.float8_e4m3fn)
    groups = (LayerGroup((0, 2), SinkWindow(0, 3), name="local"), LayerGroup((1,), SinkWindow(2, 4), name="global"))
    contexts = [StepContext(BoundedKVManager(cfg, groups=groups, block_size=8)), StepContext(UncachedHistory(cfg, groups))]
    cores = [[attention(ctx, i) for i in range(LAYERS)] for ctx in contexts]
    g = torch.Generator().manual_seed(4)
    for s in range(12):
        step = BoundedKVStep((Segment("a", 1), Segment(None, 0)), {"a": StreamPosition(0, s)})
        qkv = [(torch.randn(2, HQ, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g),
                torch.randn(2, H, 1, D, generator=g)) for _ in range(LAYERS)]
        outs = []
        for ctx, layers in zip(contexts, cores):
            ctx.bind(ctx.begin(step))
            outs.append([layer(*qkv[i]) for i, layer in enumerate(layers)])
            ctx.commit()
        for got, want in zip(*outs):
            torch.testing.assert_close(got[:1], want[:1], rtol=0, atol=1e-5)


def test_quantized_twin_refuses_rotary_it_cannot_mirror():
    cfg = config(query_window=None, slot_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"quantized slots \(slot_dtype=torch.int8\) stores rotated keys quantized"):
        UncachedHistory(cfg).rotation(0, Rotary(D), "stream")


def test_session_from_one_retention_per_layer():
    """`groups=` as one SinkWindow per layer: layers with equal retention share a group."""
    cfg = config(query_window=None)
    per_layer = [SinkWindow(0, 3), SinkWindow(2, 6), SinkWindow(0, 3)]
    session = StreamSession(cfg, groups=per_layer, compile=False, block_size=8, token_sizes=(2,))
    assert [g.layers for g in session.cache.groups] == [(0, 2), (1,)]
    groups = (LayerGroup((0, 2), SinkWindow(0, 3)), LayerGroup((1,), SinkWindow(2, 6)))
    ref = LayerReference(cfg, groups)
    for s in range(12):  # per-step windows: every feed holds the step's T tokens
        res = session.step({"a": feed(2, s), "b": feed(2, 50 + s)}, model)
        x = torch.zeros(3, 2, 3, HQ, D)
        x[res.lanes["a"]], x[res.lanes["b"]] = feed(2, s), feed(2, 50 + s)
        for layer in range(LAYERS):
            want = ref.attend(layer, *split(x, layer), res.step).transpose(1, 2)
            for rid in ("a", "b"):
                check_close(res[rid][:, layer], want[res.lanes[rid]], 1e-5, f"step {s}, layer {layer}, request {rid!r}")
        ref.commit(res.step)


def test_per_layer_retention_names_a_bad_group():
    with pytest.raises(ValueError, match=r"group 0 \(layers \[0, 2\]\): query_window=3 needs window >= 3"):
        StreamSession(config(), groups=[SinkWindow(0, 2), SinkWindow(2, 6), SinkWindow(0, 2)], compile=False)
    with pytest.raises(ValueError, match="gives 2 per-layer retentions but config.num_layers=3"):
        StreamSession(config(), groups=[SinkWindow(0, 3)] * 2, compile=False)


def test_compiled_session_over_a_grouped_cache_compiles_once_and_matches_the_reference():
    cfg = config()
    session = StreamSession(cfg, groups=GROUPS, token_sizes=(1, 3), block_size=8)
    torch._dynamo.reset()
    counters.clear()
    # Warm-up compiles the two token buckets; then nothing may compile again.
    session.warmup(model, feed(1, 0))
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2
    with torch._dynamo.config.patch(error_on_recompile=True):
        run_schedule(session, LayerReference(cfg, GROUPS), tolerance=1e-4)
    assert counters["stats"]["unique_graphs"] == graphs


def test_wrap_cores_on_a_grouped_cache_compute_what_the_grouped_twin_computes():
    """The same attention modules, rotary at in-cache positions, over the grouped cache and its twin."""
    cfg = config(query_window=None)
    groups = (LayerGroup((0, 2), SinkWindow(0, 3), name="local"), LayerGroup((1,), SinkWindow(2, 4), name="global"))
    rot = Rotary(D, base=50.0)
    contexts = [StepContext(BoundedKVManager(cfg, groups=groups, block_size=8)), StepContext(UncachedHistory(cfg, groups))]
    cores = [[attention(ctx, i, rotary=rot, rope_positions="cache") for i in range(LAYERS)] for ctx in contexts]
    g = torch.Generator().manual_seed(3)
    written = 0
    for s in range(14):
        step = BoundedKVStep((Segment("a", 1), Segment(None, 0)), {"a": StreamPosition(0, written)})
        qkv = [(torch.randn(2, HQ, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g),
                torch.randn(2, H, 1, D, generator=g)) for _ in range(LAYERS)]
        outs = []
        for ctx, layers in zip(contexts, cores):
            ctx.bind(ctx.begin(step))
            outs.append([layer(*qkv[i]) for i, layer in enumerate(layers)])
            ctx.commit()
        for got, want in zip(*outs):
            torch.testing.assert_close(got[:1], want[:1], rtol=0, atol=1e-5)
        written += 1
    # Both caches committed every step, past the global group's sink + window: in-cache positions shifted.
    assert [ctx.cache.written("a") for ctx in contexts] == [written, written] and written > 4 + 2


def test_stream_positions_are_the_same_public_view_on_every_cache():
    """A reversed chunk of 3 written tokens and one look-ahead token, next to a padding row."""
    cfg = config(query_window=None, reverse_step_order=True, max_step_tokens=4, max_source_len=5, max_sources=1)
    step = BoundedKVStep((Segment("a", 3), Segment(None, 0)), {"a": StreamPosition(5, 0, 0)}, tokens=4)
    want = torch.tensor([[7, 6, 5, 8], [0, 1, 2, 3]])  # n = 5: written tokens last-first, then look-ahead
    source = torch.zeros(LAYERS, 1, H, 5, D)
    for cache in (BoundedKVManager(cfg, block_size=8), BoundedKVManager(cfg, block_size=8),
                  UncachedHistory(cfg)):
        ctx = StepContext(cache)
        assert cache.add_source(source, source) == 0
        ctx.begin(step)
        assert torch.equal(ctx.stream_positions().cpu(), want), type(cache).__name__


def test_engine_spec_with_groups_builds_a_grouped_cache():
    cfg = config(dtype=None)
    spec = BoundedKVSpec("kv", (), cfg, groups=GROUPS)
    cache = BoundedKVResource().build(spec, EngineResourceInfo("cpu", torch.float64))
    assert isinstance(cache, BoundedKVManager) and len(cache.cache_groups) == 2
    assert [g.config.retention for g in cache.cache_groups] == [g.retention for g in GROUPS]
    assert cache.config.dtype == torch.float64
    retuned = spec.apply_yaml_overrides(max_slots=5)
    assert retuned.groups == GROUPS and BoundedKVResource().build(
        retuned, EngineResourceInfo("cpu", torch.float32)).free_slots == 5


def test_groups_with_their_own_head_sizes_attend_as_the_grouped_twin():
    """Per-group KV heads, key and value widths (a Gemma 4 / latent-attention shape) through both caches."""
    cfg = config(query_window=None, num_heads=2, head_dim=8)
    groups = (LayerGroup((0, 2), SinkWindow(0, 3), name="local"),
              LayerGroup((1,), SinkWindow(2, 4), name="global", num_heads=1, head_dim=16, value_head_dim=4))
    contexts = [StepContext(BoundedKVManager(cfg, groups=groups, block_size=8)), StepContext(UncachedHistory(cfg, groups))]
    g = torch.Generator().manual_seed(5)
    shapes = {0: (2, 8, 8), 1: (1, 16, 4), 2: (2, 8, 8)}  # layer -> (KV heads, key width, value width)
    written = 0
    for s in range(10):
        step = BoundedKVStep((Segment("a", 2), Segment(None, 0)), {"a": StreamPosition(0, written)})
        qkv = {layer: (torch.randn(2, 4, 2, dk, generator=g), torch.randn(2, h, 2, dk, generator=g),
                       torch.randn(2, h, 2, dv, generator=g)) for layer, (h, dk, dv) in shapes.items()}
        outs = []
        for ctx in contexts:
            ctx.bind(ctx.begin(step))
            outs.append([ctx(layer, *qkv[layer]) for layer in range(LAYERS)])
            ctx.commit()
        for layer, (got, want) in enumerate(zip(*outs)):
            assert got.shape == (2, 4, 2, shapes[layer][2])
            torch.testing.assert_close(got[:1], want[:1], rtol=0, atol=1e-5)
        written += 2
