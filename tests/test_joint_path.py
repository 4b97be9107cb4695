"""The joint path (`flexkv.cache.paths.joint_path`): a cache's cells and joined keys in one softmax.

Checked against a hand-worked row, the float64 reference (which shares no
code with it), the same attention computed as separate calls merged by
log-sum-exp, and the cache's own path where no joined key is read.
"""

import pytest
import torch

from configs import small_config
from flexkv import BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cache.attend_modes import Attended
from flexkv.cache.paths.joint_path import KeyPart
from flexkv.cache.paths.merge import merge_attention
from flexkv.model.attendance import AttendanceError
from flexkv.model.multi_context import MultiStepContext
from flexkv.model.reference import ReferenceCache


def make_config(retention=SinkWindow(1, 3), heads=2, dim=4, tokens=3, **changes):
    return small_config(**{"num_heads": heads, "head_dim": dim, "retention": retention, "max_step_tokens": tokens,
                           **changes})


def step_of(spans: dict, written: dict, tokens: int) -> BoundedKVStep:
    """A step of the requests in `spans` (None: a padding row) at their `written` counts."""
    segs = tuple(Segment(None, 0) if r is None else Segment(r, n) for r, n in spans.items())
    return BoundedKVStep(segs, {r: StreamPosition(0, written[r]) for r in spans if r is not None}, tokens=tokens)


def run(cache, step, fn):
    """Admit and plan `step`, call `fn(plan)`, commit; returns what `fn` returned."""
    cache.admit(step)
    out = fn(cache.plan(step))
    cache.commit(step)
    return out


def test_the_worked_example_one_softmax_over_cells_and_a_joined_key():
    """SinkWindow(1, 2) at 6 written entries, a step writing 6 and 7: both queries read entries 0, 4, 5, 6, 7
    and the joined key, six keys in one softmax (the module docstring's example)."""
    g = torch.Generator().manual_seed(0)
    c = make_config(SinkWindow(1, 2), heads=1, tokens=2, num_layers=1)
    cache = BoundedKVManager(c, "cpu")
    keys = torch.randn(8, 4, generator=g, dtype=torch.float64).float()
    values = torch.randn(8, 4, generator=g, dtype=torch.float64).float()
    for s in range(3):  # entries 0..5
        run(cache, step_of({"a": 2}, {"a": 2 * s}, 2),
            lambda p, s=s: cache.attend(0, torch.zeros(1, 1, 2, 4), keys[2 * s:2 * s + 2].view(1, 1, 2, 4),
                                        values[2 * s:2 * s + 2].view(1, 1, 2, 4), p))
    q = torch.randn(1, 1, 2, 4, generator=g)
    kj, vj = torch.randn(1, 1, 1, 4, generator=g), torch.randn(1, 1, 1, 4, generator=g)
    got = run(cache, step_of({"a": 2}, {"a": 6}, 2),
              lambda p: cache.attend_joined(0, q, keys[6:].view(1, 1, 2, 4), values[6:].view(1, 1, 2, 4), p,
                                            (KeyPart(kj, vj),)).out)
    read = [0, 4, 5, 6, 7]
    k_all = torch.cat([keys[read], kj.view(1, 4)]).double()
    v_all = torch.cat([values[read], vj.view(1, 4)]).double()
    want = torch.softmax(q.double().view(2, 4) @ k_all.T / 2.0, -1) @ v_all
    torch.testing.assert_close(got.view(2, 4).double(), want, rtol=1e-6, atol=1e-6)


@pytest.fixture
def gqa_cache():
    return BoundedKVManager(make_config(), "cpu")


def step_inputs(g, N: int, Q: int = 2, K: int = 4, T: int = 3) -> tuple:
    """`q [N, 4, T, 4]`, `q2 [N, 4, Q, 4]`, `k`, `v [N, 2, T, 4]` and joined `kj`, `vj [N, 2, K, 4]` of a GQA
    step (4 query heads over 2 KV heads)."""
    q, q2 = torch.randn(N, 4, T, 4, generator=g), torch.randn(N, 4, Q, 4, generator=g)
    k, v = torch.randn(N, 2, T, 4, generator=g), torch.randn(N, 2, T, 4, generator=g)
    return q, q2, k, v, torch.randn(N, 2, K, 4, generator=g), torch.randn(N, 2, K, 4, generator=g)


def joint(res) -> Attended:
    """A call's result over its own and query-only queries as one `Attended`: a cache's is one; the
    reference's `((out, lse), (query-only out, lse))` is joined along the queries."""
    if isinstance(res, Attended):
        return res
    (o, lo), (o2, lo2) = res
    return Attended(torch.cat([o, o2], 2), torch.cat([lo, lo2], 2))


def halves(res: Attended, T: int) -> tuple:
    """`((out, lse), (query-only out, lse))`: an `Attended` split after the step's `T` queries."""
    return (res.out[:, :, :T], res.lse[:, :, :T]), (res.out[:, :, T:], res.lse[:, :, T:])


def assert_matches(got, want, where: str) -> None:
    """A call's result (`joint`) equals `want`'s (the float64 reference's, or another cache's), to float32
    rounding."""
    (o, lo), (w, lw) = joint(got), joint(want)
    torch.testing.assert_close(o.double(), w.double(), rtol=1e-5, atol=1e-5, msg=where)
    torch.testing.assert_close(lo.double(), lw.double(), rtol=1e-5, atol=1e-5, msg=f"{where} lse")


def _parts(g, N, H, D):
    """Two parts: one of 4 keys, some missing, read by queries 1 .. 3; one of 2 keys read by all."""
    valid = torch.rand(N, 4, generator=g) > 0.3
    return (KeyPart(torch.randn(N, H, 4, D, generator=g), torch.randn(N, H, 4, D, generator=g), valid, range(1, 4)),
            KeyPart(torch.randn(N, H, 2, D, generator=g), torch.randn(N, H, 2, D, generator=g)))


@pytest.mark.parametrize("learned_sinks", [False, True], ids=["no-sinks", "learned-sinks"])
def test_equals_the_float64_reference_over_steps_with_gqa_query_only_and_padding(gqa_cache, learned_sinks):
    cache, c = gqa_cache, gqa_cache.config
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]) if learned_sinks else None
    ref = ReferenceCache(c)
    g = torch.Generator().manual_seed(1)
    written = {"a": 0, "b": 0}
    for s in range(6):
        spans = {"a": 3, None: 0, "b": 1 + s % 3}
        step = step_of(spans, written, 3)
        q, q2 = torch.randn(3, 4, 3, 4, generator=g), torch.randn(3, 4, 2, 4, generator=g)
        k, v = torch.randn(3, 2, 3, 4, generator=g), torch.randn(3, 2, 3, 4, generator=g)
        parts = _parts(g, 3, 2, 4)
        cache.admit(step)
        plan = cache.plan(step)
        for layer in range(2):
            (o, lo), (o2, lo2) = halves(cache.attend_joined(layer, q, k, v, plan, parts, query_only=q2, sinks=sinks),
                                        3)
            (w, lw), (w2, lw2) = ref.attend(layer, q, k, v, step, query_only=q2, joined=parts, return_lse=True,
                                            sinks=sinks)
            for name, a, b in (("own", o, w), ("query-only", o2, w2)):
                torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=f"step {s} layer {layer} {name}")
            # The padding row (1) reads nothing; with learned sinks every path gives it the sink logit as its
            # log-sum-exp, where the reference leaves -inf: compared on the live rows.
            for name, a, b in (("own", lo, lw), ("query-only", lo2, lw2)):
                torch.testing.assert_close(a.double()[[0, 2]], b[[0, 2]], rtol=1e-5, atol=1e-5,
                                           msg=f"step {s} layer {layer} {name} lse")
        cache.commit(step)
        ref.commit(step)
        written = {"a": written["a"] + 3, "b": written["b"] + spans["b"]}
    assert written["a"] > c.retention.sink + c.retention.window  # the ring wrapped


@pytest.mark.parametrize("slots", [2, 3], ids=["every-slot", "a-slot-free"])
def test_a_batch_of_every_slot_or_fewer_equals_the_reference(slots):
    """Steps whose rows hold every slot of the pool, or all but one: both equal the float64 reference as the
    ring wraps."""
    cache = BoundedKVManager(make_config(max_slots=slots), "cpu")
    ref = ReferenceCache(cache.config)
    g = torch.Generator().manual_seed(8)
    written = {"a": 0, "b": 0}
    for s in range(5):
        step = step_of({"a": 3, "b": 2}, written, 3)
        q, q2, k, v, kj, vj = step_inputs(g, 2)
        parts = (KeyPart(kj, vj, torch.rand(2, 4, generator=g) > 0.5, range(2, 5)),)
        cache.admit(step)
        assert_matches(cache.attend_joined(0, q, k, v, cache.plan(step), parts, query_only=q2),
                       ref.attend(0, q, k, v, step, query_only=q2, joined=parts, return_lse=True), f"step {s}")
        cache.commit(step)
        ref.commit(step)
        written = {"a": written["a"] + 3, "b": written["b"] + 2}


def test_a_padding_row_reads_nothing_not_even_joined_keys(gqa_cache):
    g = torch.Generator().manual_seed(2)
    parts = _parts(g, 2, 2, 4)
    (o, lse), (o2, lse2) = halves(run(gqa_cache, step_of({"a": 3, None: 0}, {"a": 0}, 3), lambda p: gqa_cache.attend_joined(
        0, torch.randn(2, 4, 3, 4), torch.randn(2, 2, 3, 4), torch.randn(2, 2, 3, 4), p, parts,
        query_only=torch.randn(2, 4, 2, 4))), 3)
    assert torch.all(o[1] == 0) and torch.all(o2[1] == 0)
    assert torch.all(lse[1] == float("-inf")) and torch.all(lse2[1] == float("-inf"))
    assert torch.isfinite(lse[0]).all()


def test_equals_separate_calls_merged_by_log_sum_exp(gqa_cache):
    """The same attention as the cache's own call and the joined keys' softmax, merged: exact to rounding."""
    cache = gqa_cache
    g = torch.Generator().manual_seed(3)
    written = {"a": 0, "b": 0}
    for s in range(4):
        step = step_of({"a": 3, "b": 3}, written, 3)
        q, q2, k, v, kj, vj = step_inputs(g, 2, K=5)

        def both(p):
            both = cache.attend_joined(0, q, k, v, p, (KeyPart(kj, vj),), query_only=q2)
            alone = cache.attend_query_only(0, q, k, v, p, q2)
            cache.attend(1, q, k, v, p)
            return halves(both, 3), halves(alone, 3)

        ((o, lo), (o2, lo2)), ((a, la), (a2, la2)) = run(cache, step, both)
        qa = torch.cat([q, q2], 2) * 0.5
        scores = qa @ kj.repeat_interleave(2, 1).transpose(-1, -2)
        extra = (torch.softmax(scores, -1) @ vj.repeat_interleave(2, 1), torch.logsumexp(scores, -1))
        want, want_lse = merge_attention((torch.cat([a, a2], 2), torch.cat([la, la2], 2)), extra)
        torch.testing.assert_close(torch.cat([o, o2], 2), want, rtol=1e-5, atol=1e-5, msg=f"step {s}")
        torch.testing.assert_close(torch.cat([lo, lo2], 2), want_lse, rtol=1e-5, atol=1e-5, msg=f"step {s} lse")
        written = {r: n + 3 for r, n in written.items()}


@pytest.mark.parametrize("changes", [
    dict(),
    dict(slot_dtype=torch.int8),
    dict(causal_step=True),
    dict(query_window=3, retention=SinkWindow(1, 3)),
], ids=["plain", "int8-slots", "causal-step", "query-window"])
def test_a_part_no_query_reads_leaves_the_caches_own_attention(changes):
    """Joined keys that exist nowhere change nothing: the cache's own path's result, for every mask kind."""
    cache = BoundedKVManager(make_config(**changes), "cpu")
    g = torch.Generator().manual_seed(4)
    written = {"a": 0, "b": 0}
    for s in range(5):
        step = step_of({"a": 3, "b": 2}, written, 3)
        q, q2 = torch.randn(2, 4, 3, 4, generator=g), torch.randn(2, 4, 1, 4, generator=g)
        k, v = torch.randn(2, 2, 3, 4, generator=g), torch.randn(2, 2, 3, 4, generator=g)
        none = KeyPart(torch.randn(2, 2, 3, 4, generator=g), torch.randn(2, 2, 3, 4, generator=g),
                       torch.zeros(2, 3, dtype=torch.bool))

        def both(p):
            both = cache.attend_joined(0, q, k, v, p, (none,), query_only=q2)
            own = cache.attend_query_only(0, q, k, v, p, q2)
            cache.attend(1, q, k, v, p)
            return halves(both, 3), halves(own, 3)

        got, want = run(cache, step, both)
        for (a, la), (b, lb), name in zip(got, want, ("own", "query-only")):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"step {s} {name}")
            torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-5, msg=f"step {s} {name} lse")
        written = {"a": written["a"] + 3, "b": written["b"] + 2}


def test_write_part_hands_the_newest_tokens_cells_to_another_caches_softmax():
    """A bank (one entry a step, the last 3 kept) read by the frames' queries through `write_part`: each query's
    softmax is over its frames' cells and the bank's last 3 entries, as a float64 softmax over the history."""
    g = torch.Generator().manual_seed(5)
    frames = BoundedKVManager(make_config(SinkWindow(0, 2), heads=1, tokens=2, num_layers=1), "cpu")
    bank = BoundedKVManager(make_config(SinkWindow(0, 3, window_includes_step=True), heads=1, tokens=1,
                                        num_layers=1), "cpu")
    context = MultiStepContext({"frames": frames, "bank": bank})
    fk, fv, bk, bv = [], [], [], []
    for s in range(6):
        q = torch.randn(1, 1, 2, 4, generator=g)
        k, v = torch.randn(1, 1, 2, 4, generator=g), torch.randn(1, 1, 2, 4, generator=g)
        ek, ev = torch.randn(1, 1, 1, 4, generator=g), torch.randn(1, 1, 1, 4, generator=g)
        steps = {"frames": step_of({"a": 2}, {"a": 2 * s}, 2), "bank": step_of({"a": 1}, {"a": s}, 1)}
        with context.stepping(steps):
            part = context["bank"].write_part(0, ek, ev)
            got = context["frames"].attend_joined(0, q, k, v, (part,)).out
        fk += list(k[0, 0])
        fv += list(v[0, 0])
        bk.append(ek.view(4))
        bv.append(ev.view(4))
        read_k = torch.stack(fk[-4:] + bk[-3:]).double()  # frames: 2 kept + the step's 2; bank: its last 3
        read_v = torch.stack(fv[-4:] + bv[-3:]).double()
        want = torch.softmax(q.double().view(2, 4) @ read_k.T / 2.0, -1) @ read_v
        torch.testing.assert_close(got.view(2, 4).double(), want, rtol=1e-5, atol=1e-5, msg=f"step {s}")
        assert int(part.valid.sum()) == min(s + 1, 3)


def test_a_bank_layer_never_written_fails_the_steps_attendance_check():
    """`write_part` through a step context is the layer's attendance; a layer the model skips is named."""
    frames = BoundedKVManager(make_config(SinkWindow(0, 2), heads=1, tokens=2), "cpu")
    bank = BoundedKVManager(make_config(SinkWindow(0, 3, window_includes_step=True), heads=1, tokens=1), "cpu")
    context = MultiStepContext({"frames": frames, "bank": bank})
    steps = {"frames": step_of({"a": 2}, {"a": 0}, 2), "bank": step_of({"a": 1}, {"a": 0}, 1)}
    x = torch.randn(1, 1, 2, 4)
    e = torch.randn(1, 1, 1, 4)
    with pytest.raises(AttendanceError, match="bank"):
        with context.stepping(steps):
            for layer in range(2):
                joined = (context["bank"].write_part(layer, e, e),) if layer == 0 else None
                context["frames"].attend_joined(layer, x, x, x, joined)
    assert "a" not in frames.requests and "a" not in bank.requests  # the failed step took nothing
    with pytest.raises(ValueError, match="no step"):
        MultiStepContext({"frames": frames, "bank": bank})["bank"].write_part(0, e, e)


@pytest.mark.parametrize("bad, match", [
    (lambda k: KeyPart(k, k), "must be a non-empty sequence of KeyPart"),
    (lambda k: [], "must be a non-empty sequence of KeyPart"),
    (lambda k: (KeyPart(k[:, :1], k[:, :1]),), r"parts\[0\]\.k shape expected \(2, 2, 3, 4\)"),
    (lambda k: (KeyPart(k.double(), k.double()),), r"parts\[0\]\.k must be torch.float32"),
    (lambda k: (KeyPart(k, k, torch.ones(2, 3)),), r"parts\[0\]\.valid must be a bool tensor \[N=2, K=3\]"),
    (lambda k: (KeyPart(k, k, None, range(0, 9)),), r"parts\[0\]\.queries must be a non-empty range"),
    (lambda k: ((k, k),), r"parts\[0\] must be a KeyPart"),
], ids=["bare-part", "empty", "heads", "dtype", "valid", "queries", "tuple"])
def test_a_bad_part_is_refused_by_name_and_writes_nothing(gqa_cache, bad, match):
    cache = gqa_cache
    step = step_of({"a": 3, "b": 3}, {"a": 0, "b": 0}, 3)
    cache.admit(step)
    plan = cache.plan(step)
    before = [t.clone() for t in cache.store.layer_kv(0)]
    x = torch.randn(2, 2, 3, 4)
    with pytest.raises(ValueError, match=match):
        cache.attend_joined(0, torch.randn(2, 4, 3, 4), x, x, plan, bad(x))
    assert all(torch.equal(a, b) for a, b in zip(before, cache.store.layer_kv(0)))


def test_a_score_mod_with_joined_keys_is_refused(gqa_cache):
    """`attend_joined` takes no `score_mod` (a joined key has no position in the cache); the check below it
    refuses one that reaches the path anyway."""
    step = step_of({"a": 3}, {"a": 0}, 3)
    gqa_cache.admit(step)
    x = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match="score_mod"):
        gqa_cache.attend_joined(0, torch.randn(1, 4, 3, 4), x, x, gqa_cache.plan(step), (KeyPart(x, x),),
                                score_mod=lambda s, b, h, q, k: s)
    with pytest.raises(ValueError, match="joined keys take no score_mod"):
        gqa_cache._attend(0, torch.randn(1, 4, 3, 4), x, x, gqa_cache.plan(step), score_mod=lambda s, b, h, q, k: s,
                          want_lse=True, joined=(KeyPart(x, x),))


def test_compiled_with_fullgraph_it_equals_the_reference_and_never_recompiles(gqa_cache):
    """The joint call traces whole (`fullgraph=True`), computes what the float64 reference does, and the
    steps after the first (the rings wrapping) compile nothing."""
    from torch._dynamo.utils import counters

    cache, ref = gqa_cache, ReferenceCache(gqa_cache.config)

    @torch.compile(fullgraph=True)
    def layer(q, k, v, plan, q2, kj, vj, valid):
        return cache.attend_joined(0, q, k, v, plan, (KeyPart(kj, vj, valid, range(1, 4)),), query_only=q2)

    g = torch.Generator().manual_seed(6)
    written = {"a": 0, "b": 0}
    graphs = None
    for s in range(4):
        step = step_of({"a": 3, "b": 3}, written, 3)
        q, q2, k, v, kj, vj = step_inputs(g, 2)
        valid = torch.rand(2, 4, generator=g) > 0.3
        cache.admit(step)
        assert_matches(layer(q, k, v, cache.plan(step), q2, kj, vj, valid),
                       ref.attend(0, q, k, v, step, query_only=q2, joined=(KeyPart(kj, vj, valid, range(1, 4)),),
                                  return_lse=True), f"step {s}")
        cache.commit(step)
        ref.commit(step)
        written = {r: n + 3 for r, n in written.items()}
        graphs = counters["stats"]["unique_graphs"] if graphs is None else graphs
    assert counters["stats"]["unique_graphs"] == graphs, "a step after the first compiled again"


def test_a_bank_and_frames_stack_streams_as_on_its_uncached_twin():
    """Two caches stepped as one (frames; a bank of one entry a step, read by all but the last query-only
    query), a stream joining late: every layer's output equals the same stack on the uncached twins."""
    from flexkv.model.uncached import UncachedHistory

    fc = make_config(SinkWindow(1, 3), tokens=2)
    bc = make_config(SinkWindow(0, 2, window_includes_step=True), tokens=1)
    stacks = [MultiStepContext({"frames": BoundedKVManager(fc, "cpu"), "bank": BoundedKVManager(bc, "cpu")}),
              MultiStepContext({"frames": UncachedHistory(fc), "bank": UncachedHistory(bc)})]
    g = torch.Generator().manual_seed(7)
    written = {"a": 0, "b": 0}
    for s in range(6):
        ids = ["a", "b"] if s >= 2 else ["a", None]  # "b" starts at segment 2
        steps = {"frames": step_of({r: 2 for r in ids}, written, 2),
                 "bank": step_of({r: 1 for r in ids}, {r: n // 2 for r, n in written.items()}, 1)}
        q, q2, k, v, kj, vj = step_inputs(g, 2, Q=2, K=1, T=2)
        ek, ev = torch.randn(2, 2, 1, 4, generator=g), torch.randn(2, 2, 1, 4, generator=g)
        outs = []
        for stack in stacks:
            with stack.stepping(steps):
                got = []
                for layer in range(2):
                    bank = stack["bank"].write_part(layer, ek, ev)
                    got.append(halves(stack["frames"].attend_joined(
                        layer, q, k, v, (bank.for_queries(range(3)), KeyPart(kj, vj)), query_only=q2), 2))
                outs.append(got)
        for layer, ((o, lo), (o2, lo2)) in enumerate(outs[0]):
            (w, lw), (w2, lw2) = outs[1][layer]
            live = [i for i, r in enumerate(ids) if r is not None]
            torch.testing.assert_close(torch.cat([o, o2], 2)[live], torch.cat([w, w2], 2)[live], rtol=1e-5,
                                       atol=1e-5, msg=f"segment {s} layer {layer}")
            torch.testing.assert_close(torch.cat([lo, lo2], 2)[live], torch.cat([lw, lw2], 2)[live], rtol=1e-5,
                                       atol=1e-5, msg=f"segment {s} layer {layer} lse")
        written = {r: n + (2 if r in ids else 0) for r, n in written.items()}


def test_a_segment_interrupted_after_a_bank_write_changes_nothing_and_runs_again_alike():
    """Ctrl-C after layer 0's `write_part`: both caches are as before the segment, and running it again gives
    what a stack that was never interrupted gives."""
    fc = make_config(SinkWindow(1, 3), tokens=2)
    bc = make_config(SinkWindow(0, 2, window_includes_step=True), tokens=1)
    stacks = [MultiStepContext({"frames": BoundedKVManager(fc, "cpu"), "bank": BoundedKVManager(bc, "cpu")})
              for _ in range(2)]
    g = torch.Generator().manual_seed(9)
    inputs = [step_inputs(g, 2, Q=1, K=1, T=2) + (torch.randn(2, 2, 1, 4, generator=g),) for _ in range(4)]

    def segment(stack, s, interrupt=False):
        q, q2, k, v, kj, vj, e = inputs[s]
        steps = {"frames": step_of({"a": 2, "b": 2}, {"a": 2 * s, "b": 2 * s}, 2),
                 "bank": step_of({"a": 1, "b": 1}, {"a": s, "b": s}, 1)}
        with stack.stepping(steps):
            outs = []
            for layer in range(2):
                bank = stack["bank"].write_part(layer, e, e)
                if interrupt:
                    raise KeyboardInterrupt
                outs.append(stack["frames"].attend_joined(layer, q, k, v, (bank, KeyPart(kj, vj)), query_only=q2).out)
        return outs

    for s in range(4):
        if s == 2:
            with pytest.raises(KeyboardInterrupt):
                segment(stacks[0], s, interrupt=True)
            for name in ("frames", "bank"):
                cache = stacks[0][name].cache
                assert [cache.written(r) for r in ("a", "b")] == [stacks[1][name].cache.written(r) for r in ("a", "b")]
        got, want = segment(stacks[0], s), segment(stacks[1], s)
        for layer, (o, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(o, w, rtol=0, atol=0,
                                       msg=f"segment {s} layer {layer}")


def test_a_grouped_cache_routes_joined_keys_and_parts_to_the_layers_group():
    """Layers in two retention groups: a joined call and a `write_part` on model layer 1 equal the same on a
    bounded cache of that layer's group alone."""
    from flexkv import LayerGroup

    base = make_config(SinkWindow(1, 3))
    groups = (LayerGroup((0,), SinkWindow(1, 3)), LayerGroup((1,), SinkWindow(0, 2)))
    alone = BoundedKVManager(make_config(SinkWindow(0, 2), num_layers=1), "cpu")
    wide = BoundedKVManager(base, groups=groups)
    g = torch.Generator().manual_seed(10)
    written = {"a": 0, "b": 0}
    for s in range(4):
        step = step_of({"a": 3, "b": 2}, written, 3)
        q, q2, k, v, kj, vj = step_inputs(g, 2)
        parts = (KeyPart(kj, vj, None, range(1, 5)),)
        outs = []
        for cache, layer in ((wide, 1), (alone, 0)):
            cache.admit(step)
            plan = cache.plan(step)
            if cache is wide:
                cache.attend(0, q, k, v, plan)
            part = cache.write_part(layer, k, v, plan)
            outs.append((cache.attend_joined(layer, q, k, v, plan, parts, query_only=q2), part))
            cache.commit(step)
        (got, got_part), (want, want_part) = outs
        assert_matches(got, want, f"step {s}")
        assert torch.equal(got_part.valid, want_part.valid) and torch.equal(got_part.k, want_part.k)
        written = {"a": written["a"] + 3, "b": written["b"] + 2}
