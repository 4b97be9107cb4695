"""What flexkv chooses when the user sets only the shape and retention: the attention path `attend`
takes, the KV block size, and what the eager rows path shares between layers.

Correctness of every path against the dense reference is `tests/test_properties.py`'s (eager,
every path) and `tests/test_compiled.py`'s (compiled); here: the choices themselves, that eager
calls never run FlexAttention by default, and that the per-plan work is done once per plan.
"""

import pytest
import torch
from random_workload import check_close

import flexkv.cache.paths.flex_call as flex_call_module
from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cache.cpu.fast_rows_path import FastRowsPath
from flexkv.cache.host.layout import Layout, default_block_size
from flexkv.cache.paths.attention_options import AttentionOptions
from flexkv.cache.paths.kernel_sharing import shares_flex_kernel
from flexkv.cache.paths.row_attention import RowGeometry
from flexkv.model.reference import ReferenceCache
from single_thread import one_thread  # noqa: F401


def _config(**kw):
    base = dict(num_layers=3, num_heads=2, head_dim=8, rows_per_request=1, max_source_len=0, max_sources=0,
                retention=SinkWindow(2, 9), max_slots=3, max_step_tokens=4)
    base.update(kw)
    return BoundedKVConfig(**base)


@pytest.mark.parametrize("device, tokens, compiled, path", [
    ("cpu", 1, False, "rows"), ("cpu", 4, False, "rows"), ("cpu", 1, True, "flex"), ("cpu", 4, True, "rows"),
    ("meta", 1, False, "rows"), ("meta", 1, True, "flex"), ("meta", 4, True, "flex"),
])
def test_default_path_follows_device_step_and_compilation(device, tokens, compiled, path):
    m = BoundedKVManager(_config(), device)
    assert m.path_for(tokens, compiled=compiled) == path


@pytest.mark.parametrize("forced", ["flex", "rows"])
def test_a_forced_path_is_taken_compiled_or_not(forced):
    m = BoundedKVManager(_config(), "cpu", options=AttentionOptions.for_cache(_config(), "cpu", path=forced))
    assert {m.path_for(t, compiled=c) for t in (1, 4) for c in (False, True)} == {forced}


def _stream(m, ref, steps, tokens, monkeypatch, counts):
    """Steps of two requests (one padding segment), every layer attended eagerly and checked against
    `ref`: the first step, layer and request that differs fails there."""
    c = m.config
    g = torch.Generator().manual_seed(0)
    written = 0
    for s in range(steps):
        step = BoundedKVStep((Segment("a", tokens), Segment(None, 0), Segment("b", tokens)),
                             {"a": StreamPosition(0, written), "b": StreamPosition(0, written)}, tokens=tokens)
        m.admit(step)
        before = counts["geometry"]
        plan = m.plan(step)  # a chunk's geometry is built with its plan, a token's at the first layer
        for layer in range(c.num_layers):
            q = torch.randn(3, 4, tokens, c.head_dim, generator=g)
            k, v = (torch.randn(3, 2, tokens, c.head_dim, generator=g) for _ in range(2))
            out = m.attend(layer, q, k, v, plan)
            want = ref.attend(layer, q, k, v, step)
            for row, rid in enumerate(("a", None, "b")):  # one row per request
                check_close(out[row], want[row], 1e-5, f"step {s}, layer {layer}, "
                            + ("the padding segment" if rid is None else f"request {rid!r}"))
        # One geometry per plan, whatever the number of layers.
        assert counts["geometry"] - before == 1
        m.commit(step)
        ref.commit(step)
        written += tokens


@pytest.mark.parametrize("tokens", [1, 3])
def test_eager_default_never_runs_flex_attention_and_shares_the_plan_geometry(tokens, monkeypatch):
    """Eagerly, FlexAttention would form every score of the whole layer tensor; by default `attend`
    takes the rows path instead, builds the plan's geometry at the first layer and reuses it."""
    counts = {"geometry": 0}

    def no_flex(*a, **k):
        raise AssertionError("eager attend called flex_attention")

    built = FastRowsPath.geometry

    def counting(*a, **k):
        counts["geometry"] += 1
        return built(*a, **k)

    monkeypatch.setattr(flex_call_module, "flex_attention", no_flex)
    monkeypatch.setattr(FastRowsPath, "geometry", counting)
    cfg = _config()
    m = BoundedKVManager(cfg, "cpu")
    _stream(m, ReferenceCache(cfg), 8, tokens, monkeypatch, counts)


def test_eager_geometry_is_rebuilt_for_a_new_plan_of_the_same_step():
    """The shared geometry belongs to one plan object: a second plan (even an equal one) gets its own."""
    cfg = _config(num_layers=1)
    m = BoundedKVManager(cfg, "cpu")
    step = BoundedKVStep((Segment("a", 1),), {"a": StreamPosition(0, 0)})
    m.admit(step)
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)

    def geometries():  # the geometries the manager keeps for the plan its layers last attended
        return [g for g in m.store._eager_step[1].values() if isinstance(g, RowGeometry)]

    first = m.plan(step)
    m.attend(0, q, k, v, first)
    (geometry,) = geometries()
    second = m.plan(step)
    m.attend(0, q, k, v, second)
    assert geometries()[0] is not geometry
    m.attend(0, q, k, v, second)
    assert len(geometries()) == 1


@pytest.mark.parametrize("path", ["auto", "flex"])
@pytest.mark.parametrize("tokens", [1, 3])
def test_learned_sinks_match_the_reference_definition(path, tokens):
    """Sinks join each query head's softmax as one extra score with no value (the reference's
    definition), on the eager default path and on eager FlexAttention with its log-sum-exp."""
    cfg = _config(num_layers=1)
    m = BoundedKVManager(cfg, "cpu", options=AttentionOptions.for_cache(cfg, "cpu", path=path))
    ref = ReferenceCache(cfg)
    g = torch.Generator().manual_seed(4)
    sinks = torch.randn(4, generator=g) * 2
    written = 0
    for _ in range(6):
        step = BoundedKVStep((Segment("a", tokens), Segment(None, 0)), {"a": StreamPosition(0, written)}, tokens=tokens)
        m.admit(step)
        plan = m.plan(step)
        q = torch.randn(2, 4, tokens, 8, generator=g) * 2
        k, v = (torch.randn(2, 2, tokens, 8, generator=g) for _ in range(2))
        got = m.attend(0, q, k, v, plan, sinks=sinks)
        want = ref.attend(0, q, k, v, step, sinks=sinks)
        assert (got.double() - want).abs().max().item() < 1e-5
        assert (ref.attend(0, q, k, v, step) - want).abs().max().item() > 1e-2  # the sinks matter
        m.commit(step)
        ref.commit(step)
        written += tokens


def test_commit_drops_the_eager_geometry():
    """The geometry (its bias is queries x cells floats) lives for one step: commit frees it."""
    m = BoundedKVManager(_config(num_layers=1), "cpu")
    step = BoundedKVStep((Segment("a", 3),), {"a": StreamPosition(0, 0)}, tokens=3)
    m.admit(step)
    plan = m.plan(step)
    m.attend(0, torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), plan)
    assert any(isinstance(g, RowGeometry) for g in m.store._eager_step[1].values())
    m.commit(step)
    assert m.store._eager_step == [None, {}]


def _decode_config(slots, sink=4, window=1020, **kw):
    return BoundedKVConfig(num_layers=1, num_heads=8, head_dim=64, rows_per_request=1, max_source_len=0,
                           max_sources=0, retention=SinkWindow(sink, window), max_slots=slots, **kw)


def test_cpu_block_is_one_slot_row_when_its_padding_is_small():
    """A 1025-cell slot row becomes one block once a block of padding is at most 1/16 of the pool."""
    assert default_block_size(_decode_config(16), "cpu") == 1025
    assert default_block_size(_decode_config(32), "cpu") == 1025
    lay = Layout.for_config(_decode_config(32), None, "cpu")
    assert lay.slot_row(5, 0) % lay.block_size == 0 and lay.row_blocks == 1
    # 8 slots: a block of padding would add 1/8 of the pool; powers of two instead.
    assert default_block_size(_decode_config(8), "cpu") == 128
    # Short rows, or rows beside sources, keep the powers of two.
    assert default_block_size(_decode_config(32, window=60), "cpu") == 16
    src = BoundedKVConfig(num_layers=1, num_heads=8, head_dim=64, rows_per_request=1, max_source_len=64,
                          max_sources=1, retention=SinkWindow(4, 1020), max_slots=32)
    assert default_block_size(src, "cpu") == 128


def test_cpu_block_shrinks_where_rounding_to_whole_blocks_would_waste_memory():
    """One stream decoding a token per step (sink 4 + window 252: 257 slot cells and 1 scratch cell) would hold
    288 cells in blocks of 32, 12% more than it uses; blocks of 16 hold 272 (5%). Four such streams keep 32."""
    one = _decode_config(1, window=252, max_step_tokens=1)
    assert default_block_size(one, "cpu") == 16
    assert Layout.for_config(one, None, "cpu").total_len == 272
    assert default_block_size(_decode_config(4, window=252, max_step_tokens=1), "cpu") == 32
    # A 64-token chunk: 320 slot cells and 64 of scratch, whole blocks of 32 already.
    assert default_block_size(_decode_config(1, window=252, max_step_tokens=64), "cpu") == 32


def test_a_cache_whose_steps_never_pad_holds_no_scratch_and_one_block_per_stream():
    """Without padding segments there are no scratch cells: one stream of sink 4 + window 252 holds its slot row
    alone, one block of it on the CPU (257 cells decoding a token per step: the 257 entries a query reads; 320 with a
    64-token chunk's ring headroom; where the padded cache holds 272 and 384); CUDA's blocks of 128 round up."""
    for step, padded, alone in ((1, 272, 257), (64, 384, 320)):
        pads = _decode_config(1, window=252, max_step_tokens=step)
        bare = pads.replace(padding_segments=False)
        assert Layout.for_config(pads, None, "cpu").total_len == padded
        lay = Layout.for_config(bare, None, "cpu")
        assert (lay.total_len, lay.block_size, lay.scratch_len, lay.row_blocks) == (alone, alone, 0, 1)
        assert Layout.for_config(bare, None, "cuda").total_len == -(-alone // 128) * 128
    # Four streams: four rows, one block each.
    four = _decode_config(4, window=252, max_step_tokens=64, padding_segments=False)
    assert Layout.for_config(four, None, "cpu").total_len == 4 * 320


def test_cuda_block_stays_128():
    assert default_block_size(_decode_config(32), "cuda") == default_block_size(_decode_config(32), "meta") == 128


def test_attention_options_are_fixed_when_the_cache_is_built():
    """The former knobs cannot be set on a built cache (the error names the way that works), and
    options that would be ignored or are misspelled are refused, changing nothing."""
    cfg = _config()
    m = BoundedKVManager(cfg, "cpu")
    assert m.options == AttentionOptions.for_cache(cfg, "cpu")
    for name, field in (("attention_path", "path"), ("pack_gqa", "pack_gqa"), ("full_blocks", "full_blocks"),
                        ("epilogue_barrier", "epilogue_barrier"), ("share_flex_kernel", "share_flex_kernel")):
        with pytest.raises(AttributeError, match=rf"options=AttentionOptions.for_cache\(config, device, {field}="):
            setattr(m, name, False)
    assert m.options == AttentionOptions.for_cache(cfg, "cpu")
    with pytest.raises(ValueError, match=r"path must be one of \('auto', 'rows', 'flex'\), got 'row'"):
        AttentionOptions.for_cache(cfg, "cpu", path="row")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['attention_path'\]"):
        AttentionOptions.for_cache(cfg, "cpu", attention_path="rows")
    with pytest.raises(ValueError, match="options must be a flexkv.cache.paths.attention_options.AttentionOptions"):
        BoundedKVManager(cfg, "cpu", options={"path": "rows"})
    assert AttentionOptions.for_cache(cfg, "meta").full_blocks and not AttentionOptions.for_cache(cfg, "cpu").full_blocks


@pytest.mark.parametrize("device, tokens, compiled, score_mod, sinks, quantized, route", [
    # compiled CPU decode: the shared kernel where this torch's region tracing is tested, else inline
    ("cpu", 1, True, False, False, False, ("region" if shares_flex_kernel("cpu") else "flex", True, True)),
    ("cpu", 1, True, True, False, False, ("flex", True, True)),      # a score_mod is traced inline
    ("cpu", 1, True, False, True, False, ("rows", True, False)),     # no log-sum-exp from the CPU kernel
    ("cpu", 4, True, False, False, False, ("rows", True, False)),    # compiled CPU chunk
    ("cpu", 1, False, False, False, False, ("rows", True, False)),   # eager
    # quantized compiled CPU decode: the rows path's grouped dequantize (quantized_rows), several
    # times faster there than FlexAttention over the layer's dequantized copy (docs/benchmarks.md)
    ("cpu", 1, True, False, False, True, ("rows", True, False)),
    ("cpu", 1, True, True, False, True, ("rows", True, False)),
    ("meta", 1, True, False, True, False, ("flex", False, False)),   # CUDA's defaults: inline, unpacked
    ("meta", 1, True, False, False, True, ("flex", False, False)),   # quantized there too
])
def test_one_route_per_call(device, tokens, compiled, score_mod, sinks, quantized, route):
    opts = AttentionOptions.for_cache(_config(), device)
    assert tuple(opts.route(device, tokens, 2, compiled, score_mod=score_mod, sinks=sinks,
                            quantized=quantized)) == route
