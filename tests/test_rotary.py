"""Rotary positions on a bounded cache: the RoPE maths, stream positions, and
StreamingLLM's in-cache positions served by rewriting only the sink cells.

The ``"cache"`` mode is checked against a literal StreamingLLM cache: it keeps
the retained keys un-rotated, appends each new token, re-rotates every key at
its position in the cache and the query at the last one, attends, then evicts
down to sink + window.
"""

import math

import pytest
import torch
from compile_guards import refuse_while_compiling
from random_workload import check_close

from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cache.positions.rotary import Rotary, SinkRotation, apply_rotary, rotate_half, stream_positions
from flexkv.model.reference import ReferenceCache, own_stream_indices
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)
from streamingllm import StreamingLLM

D = 16


def test_rotate_half_and_apply_by_hand():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert rotate_half(x).tolist() == [-3.0, -4.0, 1.0, 2.0]
    # head_dim 2: one pair rotated by angle = position (frequency 1).
    rot = Rotary(2)
    p = torch.tensor([[3]])
    out = rot.rotate(torch.tensor([[[[1.0, 0.0]]]]), p)
    assert torch.allclose(out, torch.tensor([[[[math.cos(3), math.sin(3)]]]]), atol=1e-6)
    cos, sin = rot.cos_sin(torch.tensor([5]))
    assert torch.allclose(apply_rotary(torch.tensor([[0.0, 1.0]]), cos, sin),
                          torch.tensor([[-math.sin(5), math.cos(5)]]), atol=1e-6)


def test_scores_depend_on_relative_position_only():
    torch.manual_seed(0)
    rot = Rotary(D, base=500.0)
    q, k = torch.randn(1, 3, 1, D, dtype=torch.float64), torch.randn(1, 3, 1, D, dtype=torch.float64)
    def score(p, j):
        return (rot.rotate(q, torch.tensor([[p]])) * rot.rotate(k, torch.tensor([[j]]))).sum(-1)
    assert torch.allclose(score(10, 4), score(1010, 1004), atol=1e-9)
    assert torch.allclose(rot.rotate(q, torch.tensor([[77]])).norm(dim=-1), q.norm(dim=-1))
    assert not torch.allclose(score(10, 4), score(10, 5))
    # float32 angles agree at small positions and lose accuracy at large ones, as documented
    f32 = Rotary(D, base=500.0, angle_dtype=torch.float32)
    p = torch.tensor([[5]])
    assert torch.allclose(f32.rotate(q, p), rot.rotate(q, p), atol=1e-6)
    far = torch.tensor([[3_000_001]])
    assert (f32.rotate(q, far) - rot.rotate(q, far)).abs().max() > 1e-3


def test_rotary_rejects_bad_arguments():
    with pytest.raises(ValueError, match="even int"):
        Rotary(7)
    with pytest.raises(ValueError, match="base must be"):
        Rotary(8, base=1)
    with pytest.raises(ValueError, match="angle_dtype must be"):
        Rotary(8, angle_dtype=torch.float16)
    with pytest.raises(ValueError, match="head_dim 4"):
        Rotary(8).rotate(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, dtype=torch.long))


@pytest.mark.parametrize("reverse", [False, True])
def test_stream_positions_follow_the_spec(reverse):
    cfg = BoundedKVConfig(1, 1, D, 2, 3, SinkWindow(2, 6), max_slots=4, max_step_tokens=4,
                          reverse_step_order=reverse)
    m = BoundedKVManager(cfg, block_size=16)
    m.add_source(torch.zeros(1, 2, 1, 3, D), torch.zeros(1, 2, 1, 3, D))
    step = BoundedKVStep((Segment("a", 3), Segment(None, 0), Segment("b", 0)),
                         {"a": StreamPosition(3, 0), "b": StreamPosition(0, 0)}, tokens=4)
    m.admit(step)
    pos = stream_positions(m.plan(step), 4, reverse).tolist()
    assert pos[0] == pos[1] == own_stream_indices(3, 3, 4, reverse)
    assert pos[4] == pos[5] == own_stream_indices(0, 0, 4, reverse)


LAYERS, R, H, HQ, SINK, WINDOW, BATCH = 2, 2, 2, 4, 4, 8, 3


def _cache_config(query_window=None, max_step_tokens=1):
    return BoundedKVConfig(LAYERS, H, D, R, 0, SinkWindow(SINK, WINDOW), max_slots=4, query_window=query_window,
                           max_step_tokens=max_step_tokens)


class GPTJRotary:
    """GPT-J's rotary embedding, literally: dimensions (2i, 2i + 1) are one complex number, turned by
    `position * base ** (-2i / D)` radians (float64)."""

    def __init__(self, head_dim, base):
        self.freqs = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)

    def rotate(self, x, positions):
        """`x [..., T, D]` at `positions` (broadcast against `[..., T]`)."""
        z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
        angles = positions.double().unsqueeze(-1) * self.freqs
        turn = torch.polar(torch.ones_like(angles), angles)
        return torch.view_as_real(z * turn).flatten(-2)


def test_interleaved_layout_is_gptj_rope():
    torch.manual_seed(4)
    x = torch.randn(2, 3, 5, D, dtype=torch.float64)
    p = torch.tensor([[0, 1, 7, 300, 12345], [4, 4, 9, 0, 2]])
    got = Rotary(D, base=500.0, layout="interleaved").rotate(x, p.view(2, 5))
    torch.testing.assert_close(got, GPTJRotary(D, 500.0).rotate(x, p.view(2, 1, 5)), rtol=0, atol=1e-12)
    # The half-split layout turns other pairs: same norms, different vectors.
    half = Rotary(D, base=500.0).rotate(x, p)
    assert (half - got).abs().max() > 1e-2
    torch.testing.assert_close(half.norm(dim=-1), got.norm(dim=-1))
    with pytest.raises(ValueError, match=r"layout must be one of \('half', 'interleaved'\)"):
        Rotary(D, layout="gptj")


def _run_against_streamingllm(cfg, steps, step_fn, seed, layout="half", rotated_inputs=False, from_cache=False):
    """Decode `steps` steps for a churning batch; compare every live row with StreamingLLM.

    The first step, layer and request further than 2e-5 from it fails there; returns the length `r2`
    (the longest stream) reached. With
    `layout="interleaved"` the reference rotates with `GPTJRotary`, written apart from flexkv's.
    `from_cache`: the rotations are the cache's (`m.rotation`), which make their shared parts with each plan.
    """
    torch.manual_seed(seed)
    m = BoundedKVManager(cfg, block_size=16)
    rot = Rotary(D, base=100.0, layout=layout)
    if from_cache:
        layers = [m.rotation(i, rot, "cache", rotated_inputs=rotated_inputs) for i in range(LAYERS)]
    else:
        layers = [SinkRotation(m, i, rot, "cache", rotated_inputs=rotated_inputs) for i in range(LAYERS)]
    ref = StreamingLLM(GPTJRotary(D, 100.0) if layout == "interleaved" else rot, SINK, WINDOW, D ** -0.5)
    live = ["r0", "r1", None]
    written = {}
    for step_no in range(steps):
        segs = tuple(Segment(rid, 1) if rid else Segment(None, 0) for rid in live)
        pos = {rid: StreamPosition(0, written.setdefault(rid, 0)) for rid in live if rid}
        step = BoundedKVStep(segs, pos)
        m.admit(step)
        layers[0].check_step(step)
        plan = m.plan(step)
        N = BATCH * R
        qs = [torch.randn(N, HQ, 1, D) for _ in range(LAYERS)]
        ks = [torch.randn(N, H, 1, D) for _ in range(LAYERS)]
        vs = [torch.randn(N, H, 1, D) for _ in range(LAYERS)]
        if rotated_inputs:  # as a model that rotates at the stream positions the cache gives it
            at = m.stream_positions(plan, 1)
            outs = step_fn(m, layers, plan, [rot.rotate(q, at) for q in qs], [rot.rotate(k, at) for k in ks], vs)
        else:
            outs = step_fn(m, layers, plan, qs, ks, vs)
        for li in range(LAYERS):
            for si, rid in enumerate(live):
                rows = slice(si * R, si * R + R)
                if rid is None:
                    assert outs[li][rows].abs().max() == 0
                    continue
                exp = ref.attend(li, rid, qs[li][rows], ks[li][rows], vs[li][rows])
                check_close(outs[li][rows], exp, 2e-5, f"step {step_no}, layer {li}, request {rid!r} (segment {si})")
        m.commit(step)
        for rid in live:
            if rid:
                written[rid] += 1
        # churn: a request joins in the padding row, one finishes and a new one takes its
        # slot (stale sink copies and cells underneath), one is reset to an empty stream
        if step_no == 4:
            live[2] = "r2"
        elif step_no == 13:
            m.remove_request("r0"); ref.drop("r0"); live[0] = None
        elif step_no == 15:
            live[0] = "r3"
        elif step_no == 18:
            m.reset_request("r1"); ref.drop("r1"); written["r1"] = 0
    return written["r2"]


def _eager_step(m, layers, plan, qs, ks, vs):
    outs = []
    for li, rot in enumerate(layers):
        q, k = rot(qs[li], ks[li], plan)
        outs.append(m.attend(li, q, k, vs[li], plan))
    return outs


@pytest.mark.parametrize("query_window,steps,layout", [(None, 30, "half"), (WINDOW, 26, "half"),
                                                       (None, 30, "interleaved")])
def test_cache_positions_match_streamingllm_eager(query_window, steps, layout):
    longest = _run_against_streamingllm(_cache_config(query_window), steps, _eager_step, seed=1, layout=layout)
    assert longest >= SINK + WINDOW + 8  # past the window, so sinks have been re-rotated several times


@pytest.mark.parametrize("query_window", [None, WINDOW])
def test_cache_positions_from_queries_and_keys_the_model_rotated_match_streamingllm(query_window):
    """`rotated_inputs=True` (what FlexKVCache uses): q and k arrive rotated at stream positions and only the
    sink cells are turned, by the eviction count; the result is StreamingLLM's, through churn and resets."""
    longest = _run_against_streamingllm(_cache_config(query_window), 30, _eager_step, seed=3, rotated_inputs=True)
    assert longest >= SINK + WINDOW + 8


@pytest.fixture(scope="module")
def compiled_step():
    return torch.compile(_eager_step, fullgraph=True, dynamic=False)


def test_cache_positions_match_streamingllm_compiled_without_recompiles(compiled_step):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    longest = _run_against_streamingllm(_cache_config(), 34, compiled_step, seed=2)
    assert longest >= SINK + WINDOW + 12
    assert counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.parametrize("rotated_inputs", [False, True])
def test_the_caches_rotations_take_their_sink_parts_from_the_plan_compiled(rotated_inputs, monkeypatch):
    """Rotations handed out by the cache (`m.rotation`): each plan carries the sink geometry and turns every
    layer reads (`SinkRotation.prepare`), so the compiled step forms none of them in its graph (forming one
    while tracing fails the fullgraph compile here) and still matches StreamingLLM, one graph throughout."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    refuse_while_compiling(monkeypatch, SinkRotation, ("_sink_geometry", "_sink_turn", "_entry_cells", "_query_sinks", "_query_turn"), "compiled step")
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    step = torch.compile(_eager_step, fullgraph=True, dynamic=False)
    longest = _run_against_streamingllm(_cache_config(), 30, step, seed=4, rotated_inputs=rotated_inputs,
                                        from_cache=True)
    assert longest >= SINK + WINDOW + 8
    assert counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.parametrize("from_cache", [False, True])
def test_layers_with_different_rotaries_each_turn_their_sinks_by_their_own(from_cache):
    """Two layers of one cache rotate by different rotaries (a model's local and global layers): each
    layer's sinks turn by its own, in a step whose layers share what they can. Layer 1 beside a layer
    with another rotary answers as it does beside a layer with its own, past the window."""
    rot_a, rot_b = Rotary(D, base=100.0), Rotary(D, base=10000.0)

    def run(rotaries):
        m = BoundedKVManager(_cache_config(), block_size=16)
        if from_cache:
            layers = [m.rotation(i, r, "cache", rotated_inputs=True) for i, r in enumerate(rotaries)]
        else:
            layers = [SinkRotation(m, i, r, "cache", rotated_inputs=True) for i, r in enumerate(rotaries)]
        torch.manual_seed(5)
        outs = []
        for n in range(SINK + WINDOW + 6):
            step = BoundedKVStep((Segment("r", 1),), {"r": StreamPosition(0, n)})
            m.admit(step)
            plan = m.plan(step)
            at = m.stream_positions(plan, 1)
            for li, (rot, rotary) in enumerate(zip(layers, rotaries)):
                q, k, v = torch.randn(R, HQ, 1, D), torch.randn(R, H, 1, D), torch.randn(R, H, 1, D)
                q, k = rot(rotary.rotate(q, at), rotary.rotate(k, at), plan)
                out = m.attend(li, q, k, v, plan)
                if li == 1:
                    outs.append(out)
            m.commit(step)
        return torch.stack(outs)

    assert LAYERS == 2
    torch.testing.assert_close(run([rot_a, rot_b]), run([rot_b, rot_b]), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_stream_mode_is_rotation_at_stream_index(layout):
    """In "stream" mode the cache attends keys rotated at their stream index (checked on the dense
    reference; the interleaved layout rotated by `GPTJRotary`)."""
    torch.manual_seed(3)
    cfg = _cache_config(max_step_tokens=3)
    m = BoundedKVManager(cfg, block_size=16)
    rot = Rotary(D, layout=layout)
    literal = GPTJRotary(D, 10000.0) if layout == "interleaved" else rot
    layer = SinkRotation(m, 0, rot, "stream")
    assert layer.memory_bytes == 0
    ref = ReferenceCache(cfg)
    written = 0
    for _ in range(8):
        step = BoundedKVStep((Segment("a", 3),), {"a": StreamPosition(0, written)})
        m.admit(step)
        plan = m.plan(step)
        q, k, v = torch.randn(R, HQ, 3, D), torch.randn(R, H, 3, D), torch.randn(R, H, 3, D)
        qr, kr = layer(q, k, plan)
        out = m.attend(0, qr, kr, v, plan)
        p = torch.arange(written, written + 3)
        exp = ref.attend(0, literal.rotate(q.double(), p), literal.rotate(k.double(), p), v, step)
        assert (out.double() - exp).abs().max() < 2e-5
        m.commit(step); ref.commit(step)
        written += 3


def test_cache_mode_rejects_what_it_cannot_serve():
    rot = Rotary(D)
    shared_sink = BoundedKVConfig(1, H, D, 1, 8, SinkWindow(4, 8), max_slots=2)
    with pytest.raises(ValueError, match="source_len=1 puts 1 of the 4 sink entries in a shared source"):
        SinkRotation(BoundedKVManager(shared_sink, block_size=16), 0, rot, "cache")
    # sinks in the slot for L == 0 and no sink when a source is read: fine
    ok = BoundedKVConfig(1, H, D, 1, 8, lambda L: SinkWindow(0 if L else 4, 8), max_slots=2)
    SinkRotation(BoundedKVManager(ok, block_size=16), 0, rot, "cache")
    with pytest.raises(ValueError, match="mode must be one of"):
        SinkRotation(BoundedKVManager(ok, block_size=16), 0, rot, "absolute")
    with pytest.raises(ValueError, match="head_dim=8 differs"):
        SinkRotation(BoundedKVManager(ok, block_size=16), 0, Rotary(8), "cache")

    cfg = _cache_config(query_window=WINDOW, max_step_tokens=4)
    layer = SinkRotation(BoundedKVManager(cfg, block_size=16), 0, rot, "cache")
    before = BoundedKVStep((Segment("a", 4),), {"a": StreamPosition(0, SINK + WINDOW - 3)})
    layer.check_step(before)  # the last query still evicts nothing
    past = BoundedKVStep((Segment("a", 4),), {"a": StreamPosition(0, SINK + WINDOW - 2)})
    with pytest.raises(ValueError, match="one eviction count per step"):
        layer.check_step(past)
    SinkRotation(BoundedKVManager(cfg, block_size=16), 0, rot, "stream").check_step(past)  # stream mode: any step


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_float32_angles_are_the_common_float32_implementation_bit_for_bit(layout):
    """`Rotary(angle_dtype=torch.float32)` computes what the usual float32 RoPE code computes, written out
    here literally, far into a stream (positions 500 and 50,000), in both pair layouts."""
    dim, base = 64, 10000
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    t = torch.tensor([500, 50_000, 7]).float()
    freqs = torch.outer(t, inv_freq)  # angles t * inv_freq, in float32
    emb = torch.cat((freqs, freqs), dim=-1) if layout == "half" else torch.repeat_interleave(freqs, 2, dim=-1)
    x = torch.randn(1, 2, 3, dim, generator=torch.Generator().manual_seed(0))
    if layout == "half":
        rotated = torch.cat((-x[..., dim // 2:], x[..., :dim // 2]), dim=-1)
    else:
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    want = x * emb.cos() + rotated * emb.sin()
    rot = Rotary(dim, base, angle_dtype=torch.float32, layout=layout)
    assert torch.equal(rot.inv_freq, inv_freq)
    assert torch.equal(rot.rotate(x, torch.tensor([[500, 50_000, 7]])), want)
    # float64 angles are another rounding: visibly so at 50,000
    f64 = Rotary(dim, base, layout=layout).rotate(x, torch.tensor([[500, 50_000, 7]]))
    assert (f64 - want)[..., 1, :].abs().max() > 1e-4


def test_a_models_own_frequencies_reproduce_its_rope_exactly():
    """A model that computes its frequencies as `exp(-arange * 2 log(base) / D)` (the ring transformer of
    examples/) is reproduced bit for bit with `inv_freq=` its own frequencies."""
    from examples.ring_transformer import apply_rope

    D, base = 32, 10000.0
    own = torch.exp(torch.arange(D // 2, dtype=torch.float32) * (-2 * math.log(base) / D))
    q = torch.randn(1, 3, 2, D, generator=torch.Generator().manual_seed(1))  # [B, T, H, D]
    pos = torch.tensor([[500, 50_000, 3]])
    want, _ = apply_rope(q, q, pos, base)
    rot = Rotary(D, base, angle_dtype=torch.float32, layout="interleaved", inv_freq=own)
    assert torch.equal(rot.rotate(q.transpose(1, 2), pos).transpose(1, 2), want)
    # the pow formula rounds differently: another model at 50,000
    other = Rotary(D, base, angle_dtype=torch.float32, layout="interleaved").rotate(q.transpose(1, 2), pos)
    assert (other.transpose(1, 2) - want).abs().max() > 1e-5
    with pytest.raises(ValueError, match=r"inv_freq must be a float tensor of shape \[head_dim / 2\] = \[16\]"):
        Rotary(D, inv_freq=torch.ones(D))
