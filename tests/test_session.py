"""StreamSession: the step loop, checked against the dense reference (flexkv.model.reference).

The model here is attention only: `fn` turns each request's feed (a
`[T, 3, heads, head_dim]` tensor holding q, k and v per token) into every
layer's attention output, so each output can be compared with
`ReferenceCache.attend` on the step the session ran.
"""

from functools import partial

import pytest
import torch
import torch._dynamo
from random_workload import check_close
from torch._dynamo.utils import counters

from configs import small_config
from flexkv import BoundedKVManager, Chunk, SinkWindow, SlotsExhausted, Stages, StreamSession
from flexkv.model.attendance import AttendanceError
from flexkv.model.reference import ReferenceCache
from session_models import LAYERS, TOLERANCE, D, H, check_step, feed, model
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

config = partial(small_config, num_layers=LAYERS, num_heads=H, head_dim=D, query_window=6)


class Checked:
    """A session and the reference, stepped together: `step` fails at the first layer and request that
    differs from the reference, naming the step."""

    def __init__(self, cfg, **kw):
        self.cfg = cfg
        self.session = StreamSession(BoundedKVManager(cfg, block_size=8), compile=False, **kw)
        self.ref = ReferenceCache(cfg)
        self.steps = 0

    def step(self, feeds):
        res = self.session.step(feeds, model)
        self.steps += 1
        if res.step is not None:
            check_step(self.ref, res, feeds, where=f"session step {self.steps - 1}")
        return res

    def finish(self, rid):
        self.session.finish(rid)
        self.ref.remove_request(rid)


@pytest.fixture
def checked():
    return Checked(config())


def test_decode_and_chunks_of_any_length_match_the_reference(checked):
    """Per-query window: requests feed 1..3 tokens in one step, far past the window, and leave."""
    for s in range(24):
        feeds = {"a": feed(1 + s % 3, s), "b": feed(1, 100 + s)}
        if s >= 5:
            feeds["c"] = feed(2, 200 + s)
        if s == 15:
            checked.finish("b")
        checked.step(feeds)
    assert checked.session.written("a") == sum(1 + s % 3 for s in range(24)) > 3 * 8


def test_lanes_are_the_lowest_free_and_stay_with_the_request(checked):
    s = checked.session
    res = checked.step({"a": feed(1, 0), "b": feed(1, 1), "c": feed(1, 2)})
    assert res.lanes == {"a": 0, "b": 1, "c": 2}
    checked.finish("a")
    res = checked.step({"c": feed(1, 3), "d": feed(1, 4)})
    assert res.lanes == {"c": 2, "d": 0}  # the newcomer takes lane 0; "c" keeps its lane
    assert s.requests == ("d", "b", "c")


def test_batch_pads_to_the_smallest_bucket_and_tokens_to_the_smallest_size():
    c = Checked(config(max_slots=4), batch_sizes=(2, 4), token_sizes=(1, 3))
    res = c.step({"a": feed(1, 0)})
    assert (len(res.step.segments), res.step.step_tokens) == (2, 1)
    res = c.step({"a": feed(2, 1), "b": feed(1, 2), "c": feed(1, 3)})
    assert (len(res.step.segments), res.step.step_tokens) == (4, 3)
    assert [seg.request_id for seg in res.step.segments] == ["a", "b", "c", None]


def test_queue_admits_waiting_requests_first_come_first_served():
    c = Checked(config(max_slots=2))
    s = c.session
    assert s.start("a") and s.start("b")
    assert not s.start("c") and not s.start("d")
    res = c.step({"a": feed(1, 0), "c": feed(1, 1)})
    assert res.waiting == ("c",) and list(res) == ["a"]
    c.finish("a")
    assert s.waiting == ("d",) and s.lane("c") == 0
    res = c.step({"c": feed(1, 2), "b": feed(1, 3)})
    assert set(res.lanes) == {"b", "c"}


def test_refuse_raises_and_changes_nothing():
    c = Checked(config(max_slots=2), when_full="refuse")
    c.step({"a": feed(1, 0)})
    with pytest.raises(SlotsExhausted, match=r"starts 2 new request\(s\) but only 1 of 2 lanes are free"):
        c.session.step({"a": feed(1, 1), "b": feed(1, 2), "c": feed(1, 3)}, model)
    assert c.session.requests == ("a",) and c.session.written("a") == 1 and c.session.cache.free_slots == 1
    assert c.session.start("b")
    with pytest.raises(SlotsExhausted, match="when_full='queue'"):
        c.session.start("c")
    assert c.session.requests == ("a", "b") and c.session.waiting == ()


def test_per_step_window_refuses_feeds_shorter_than_the_step():
    """Without a per-query window every query attends the whole step, so padding a feed would be read."""
    c = Checked(config(query_window=None))
    c.step({"a": feed(3, 0)})
    with pytest.raises(ValueError, match=r"request 'b' feeds 1 tokens in a step of T=3; with a per-step window"):
        c.session.step({"a": feed(3, 1), "b": feed(1, 2)}, model)
    assert c.session.requests == ("a",) and c.session.written("a") == 3
    res = c.step({"a": Chunk(feed(3, 3), span=1), "b": feed(3, 4)})  # look-ahead: a writes 1 of 3
    assert c.session.written("a") == 4 and res.step.segments[0].span == 1


def test_sources_and_reset_to_another_source():
    cfg = config(max_source_len=5, max_sources=2, query_window=None, retention=lambda L: SinkWindow(L, 4))
    c = Checked(cfg)
    shapes = [(LAYERS, 1, H, n, D) for n in (5, 3)]
    for i, shape in enumerate(shapes):
        k, v = torch.randn(shape), torch.randn(shape)
        assert c.session.add_source(k, v) == i
        c.ref.add_source(i, k, v)
    c.session.start("a", source=0, source_len=5)
    for s in range(5):
        c.step({"a": feed(3, s)})
    c.session.reset("a", source=1, source_len=3)
    c.ref.reset_request("a")
    assert c.session.written("a") == 0
    for s in range(5):
        c.step({"a": feed(3, 10 + s)})
    assert c.session.cache.sources == {0: 5, 1: 3}


def test_state_is_carried_per_request_and_renewed_on_reset():
    s = StreamSession(BoundedKVManager(config(), block_size=8), compile=False,
                      initial_state=lambda: torch.zeros(2))

    def counting(attn, x, state):  # counts the tokens each request fed, in its state
        model(attn, x)
        return x[:, :, 0, 0, 0], state + (x[:, :, 1, 0, 0] != 0).sum(1, keepdim=True).float()

    ones = torch.ones(2, 3, H, D)
    s.step({"a": ones, "b": ones[:1]}, counting)
    s.step({"a": ones[:1]}, counting)
    assert s.state("a").tolist() == [3.0, 3.0] and s.state("b").tolist() == [1.0, 1.0]
    s.reset("a")
    assert s.state("a").tolist() == [0.0, 0.0]


@pytest.mark.parametrize("feeds, match", [
    ({}, r"feeds must be a non-empty mapping"),
    ({"a": feed(4, 0)}, r"request 'a' feeds 4 tokens, more than the largest token size 3"),
    ({"a": Chunk(feed(2, 0), span=3)}, r"request 'a': Chunk span must be an int in \[0, 2\]"),
    ({"a": feed(1, 0), "b": torch.zeros(1, 3, H, D + 1)}, r"requests 'a' and 'b' feed differently shaped inputs"),
    ({"a": [feed(2, 0), torch.zeros(3)]}, r"request 'a': every tensor it feeds needs its tokens along dim 0"),
    ({"a": "tokens"}, r"the feed of request 'a' must be a tensor or a tuple, list or dict of tensors"),
    ({None: feed(1, 0)}, r"request id None is reserved for padding"),
])
def test_bad_feeds_raise_and_change_nothing(checked, feeds, match):
    checked.step({"z": feed(1, 9)})
    with pytest.raises(ValueError, match=match):
        checked.session.step(feeds, model)
    assert checked.session.requests == ("z",) and checked.session.written("z") == 1


@pytest.mark.parametrize("kw, match", [
    (dict(when_full="drop"), r"when_full must be one of \('queue', 'refuse'\)"),
    (dict(token_sizes=(4,)), r"token_sizes must be a non-empty sequence of ints in \[1, max_step_tokens=3\]"),
    (dict(batch_sizes=()), r"batch_sizes must be a non-empty sequence of ints in \[1, max_slots=3\]"),
], ids=["when_full", "token_sizes", "batch_sizes"])
def test_bad_session_arguments_are_named(kw, match):
    with pytest.raises(ValueError, match=match):
        StreamSession(config(), **kw)


def test_starting_the_padding_id_is_refused_and_changes_nothing(checked):
    checked.step({"z": feed(1, 9)})
    with pytest.raises(ValueError, match=r"request id None is reserved for padding"):
        checked.session.start(None)
    assert checked.session.requests == ("z",) and checked.session.written("z") == 1


def test_compiling_needs_a_cache_that_traces():
    from flexkv.model.uncached import UncachedHistory
    with pytest.raises(ValueError, match=r"compile=True needs a cache whose attention traces"):
        StreamSession(UncachedHistory(config()))


def test_finishing_an_unknown_request_is_refused():
    with pytest.raises(ValueError, match=r"request 'x' holds no lane; start\(\) it or feed it to step\(\)"):
        StreamSession(config(), compile=False).finish("x")


def test_starting_a_request_twice_is_refused():
    s = StreamSession(config(), compile=False)
    s.start("a")
    with pytest.raises(ValueError, match=r"request 'a' is already started"):
        s.start("a")


def test_starting_on_a_source_the_cache_cannot_hold_is_refused():
    with pytest.raises(ValueError, match=r"request 'b': source_len=2 is outside \[min_source_len=0, max_source_len=0\]"):
        StreamSession(config(), compile=False).start("b", source_len=2)


def test_compiled_session_warms_every_bucket_once_and_never_recompiles():
    """Two token sizes -> two graphs at the first step; then churn, wraps and mixed lengths compile nothing."""
    cfg = config()
    script = [{"a": feed(1 + 2 * (s % 2), s), "b": feed(1, 50 + s)} if s < 9 else {"a": feed(1 + 2 * (s % 2), s)}
              for s in range(16)]
    eager = Checked(cfg)  # first, so eager FlexAttention's own graphs are not counted below
    want = []
    for feeds in script:
        if "b" not in feeds and "b" in eager.session.requests:
            eager.finish("b")
        res = eager.step(feeds)
        want.append({r: res[r] for r in feeds})
    torch._dynamo.reset()
    compiled = StreamSession(BoundedKVManager(cfg, block_size=8), token_sizes=(1, 3))
    before = counters["stats"]["unique_graphs"]
    for s, feeds in enumerate(script):
        if "b" not in feeds and "b" in compiled.requests:
            compiled.finish("b")
        with torch._dynamo.config.patch(error_on_recompile=s > 0):
            got = compiled.step(feeds, model)
        assert counters["stats"]["unique_graphs"] - before == 2
        for r in feeds:
            check_close(got[r], want[s][r], TOLERANCE, f"compiled step {s}, request {r!r} (against the eager session)")


def _stage(layer):
    """Layer `layer` of `session_models.model` as a step stage: `(x, outputs so far)` in, one more out."""
    def stage(attn, carry):
        x, outs = carry if layer else (carry, ())
        q, k, v = ((x[:, :, i] * (layer + 1)).transpose(1, 2) for i in range(3))
        outs = outs + (attn(layer, q, k, v).transpose(1, 2),)
        return (x, outs) if layer < LAYERS - 1 else torch.stack(outs, dim=2)

    return stage


STAGED = Stages(*(_stage(layer) for layer in range(LAYERS)))


def test_stages_compile_one_graph_each_and_equal_the_reference():
    """A step in stages (one per layer) compiles one graph per stage at warm-up and none after; every
    step equals the dense reference, and the stages' attendance counts as the whole model's."""
    cfg = config()
    torch._dynamo.reset()
    session = StreamSession(BoundedKVManager(cfg, block_size=8), token_sizes=(1,))
    ref = ReferenceCache(cfg)
    before = counters["stats"]["unique_graphs"]
    for s in range(12):
        feeds = {"a": feed(1, s), "b": feed(1, 50 + s)} if s < 7 else {"a": feed(1, s)}
        if s == 7:
            session.finish("b")
            ref.remove_request("b")
        with torch._dynamo.config.patch(error_on_recompile=s > 0):
            res = session.step(feeds, Stages(*STAGED.stages))  # a new Stages of the same stages: the same step
        assert counters["stats"]["unique_graphs"] - before == LAYERS
        check_step(ref, res, feeds, where=f"staged step {s}")


def test_stages_missing_a_layer_are_refused_by_the_attendance_check_and_change_nothing():
    c = Checked(config())
    c.step({"a": feed(1, 0)})
    with pytest.raises(AttendanceError, match=r"cache layers 0-1 \(of 2\) were never attended"):
        c.session.step({"a": feed(1, 1)}, Stages(lambda attn, x: x))
    assert c.session.written("a") == 1
    res = c.session.step({"a": feed(1, 2)}, STAGED)  # eager stages run as written
    check_step(c.ref, res, {"a": feed(1, 2)})


def test_stages_need_callables_and_a_session_without_carried_state():
    with pytest.raises(ValueError, match=r"Stages takes one or more callables f\(attn, x\), got \(3,\)"):
        Stages(3)
    session = StreamSession(BoundedKVManager(config(), block_size=8), compile=False,
                            initial_state=lambda rid: torch.zeros(1))
    with pytest.raises(ValueError, match="initial_state takes a whole step function"):
        session.step({"a": feed(1, 0)}, STAGED)
    assert session.requests == ()
