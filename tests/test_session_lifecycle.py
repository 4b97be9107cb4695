"""StreamSession's lifecycle: every operation happens whole or raises with nothing changed.

Waiting requests, resets, private sources, model functions that raise
(`KeyboardInterrupt` too), re-entrant and concurrent calls, and the model
state a stateful `fn` returns. Each test drives one sequence and then checks
that the session still computes what the dense reference computes.
"""

import threading
from functools import partial

import pytest
import torch

from configs import small_config
from flexkv import BoundedKVManager, BoundedKVStep, Segment, StreamPosition, StreamSession
from flexkv.model.reference import ReferenceCache
from session_models import LAYERS, D, H, check_step, feed, model
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

config = partial(small_config, num_layers=LAYERS, num_heads=H, head_dim=D, max_source_len=6, max_sources=3,
                 max_slots=2, query_window=6)


def source(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 1, H, n, D, generator=g), torch.randn(LAYERS, 1, H, n, D, generator=g)


class Checked:
    """A session and the reference, stepped together."""

    def __init__(self, **kw):
        self.cfg = config()
        self.session = StreamSession(BoundedKVManager(self.cfg, block_size=8), compile=False, **kw)
        self.ref = ReferenceCache(self.cfg)
        self.steps = 0

    def add_source(self, n, seed):
        k, v = source(n, seed)
        index = self.session.add_source(k, v)
        self.ref.add_source(index, k, v)
        return index

    def add_private_source(self, rid, n, seed):
        k, v = source(n, seed)
        self.session.add_private_source(rid, k, v)
        self.ref.add_private_source(rid, k, v)

    def step(self, feeds, fn=model):
        """One session step, checked against the reference: the first layer and request that differs
        fails, naming the step."""
        res = self.session.step(feeds, fn)
        self.steps += 1
        check_step(self.ref, res, feeds, None if fn is model else model_outputs, where=f"session step {self.steps - 1}")

    def snapshot(self):
        s = self.session
        return (s.requests, s.waiting, {r: s.written(r) for r in s.requests}, s.cache.free_slots,
                dict(s.cache.private_sources), dict(s.cache.sources))


def model_outputs(res, rid):
    out = res[rid]
    return out[0] if isinstance(out, tuple) else out


@pytest.fixture
def full():
    """Both lanes held by "a" (on shared source 0) and "b"; "c" has a private source of 4 entries."""
    c = Checked()
    c.add_source(6, 1)
    c.session.start("a", source=0, source_len=5)
    c.session.start("b")
    c.add_private_source("c", 4, 2)
    c.step({"a": feed(2, 3), "b": feed(1, 4)})
    return c


def test_waiting_start_with_a_source_len_past_its_private_source_is_refused_at_start(full):
    before = full.snapshot()
    with pytest.raises(ValueError, match=r"request 'c': source_len=5 is longer than its private source \(4 entries\)"):
        full.session.start("c", source=-1, source_len=5)
    assert full.snapshot() == before
    # The request can still start correctly, waits, and takes the lane "b" leaves.
    assert full.session.start("c", source=-1, source_len=4) is False
    full.session.finish("b")
    full.ref.remove_request("b")
    assert full.session.lane("c") == 1
    for _ in range(4):
        full.step({"a": feed(1, 5), "c": feed(3, 6)})


def test_remove_source_is_refused_while_a_waiting_request_declares_it(full):
    index = full.add_source(3, 7)
    assert index == 2  # place 1 holds c's private source
    assert full.session.start("d", source=index, source_len=3) is False
    before = full.snapshot()
    with pytest.raises(ValueError, match=r"remove_source: source 2 is declared by waiting requests \['d'\]"):
        full.session.remove_source(index)
    assert full.snapshot() == before
    full.session.finish("b")
    full.ref.remove_request("b")
    assert full.session.requests == ("a", "d")
    full.step({"a": feed(1, 8), "d": feed(2, 9)})


def test_reset_past_the_private_source_is_refused_before_the_stream_is_rewound():
    c = Checked()
    c.add_private_source("p", 3, 1)
    c.session.start("p", source=-1, source_len=3)
    c.step({"p": feed(2, 2)})
    before = c.snapshot()
    with pytest.raises(ValueError, match=r"request 'p': source_len=5 is longer than its private source \(3 entries\)"):
        c.session.reset("p", source_len=5)
    assert c.snapshot() == before and c.session.cache.written("p") == 2
    c.step({"p": feed(1, 3)})  # the stream goes on where it was


def test_reset_of_a_waiting_request_to_a_too_long_private_source_is_refused(full):
    assert full.session.start("c") is False
    before = full.snapshot()
    with pytest.raises(ValueError, match=r"request 'c': source_len=6 is longer than its private source"):
        full.session.reset("c", source=-1, source_len=6)
    assert full.snapshot() == before
    full.session.reset("c", source=-1, source_len=4)
    full.session.finish("a")
    full.ref.remove_request("a")
    full.step({"b": feed(1, 5), "c": feed(2, 6)})


def test_finishing_a_waiting_request_frees_its_private_source(full):
    assert full.session.start("c", source=-1, source_len=4) is False
    full.session.finish("c")
    assert full.session.waiting == () and "c" not in full.session.cache.private_sources


def test_finishing_a_request_that_never_started_frees_its_private_source(full):
    full.session.finish("c")
    assert "c" not in full.session.cache.private_sources
    with pytest.raises(ValueError, match=r"request 'c' holds no lane"):
        full.session.finish("c")


def test_remove_private_source_is_refused_while_a_waiting_request_declares_it(full):
    assert full.session.start("c", source=-1, source_len=4) is False
    with pytest.raises(ValueError, match=r"waiting request 'c' is declared on it"):
        full.session.remove_private_source("c")
    assert "c" in full.session.cache.private_sources


def test_a_waiting_request_whose_source_vanished_keeps_its_place_and_says_why(full):
    """A source removed behind the session's back (on the cache itself): the lane it would take stays
    free, the request keeps waiting, and feeding it names the reason; a reset puts it right."""
    index = full.add_source(3, 7)
    assert full.session.start("d", source=index, source_len=3) is False
    full.session.cache.remove_source(index)
    full.session.finish("b")
    full.ref.remove_request("b")
    assert full.session.waiting == ("d",) and full.session.free_lanes == 1
    with pytest.raises(ValueError, match=r"request 'd' waits for a lane but can no longer start: .*unknown source 2"):
        full.session.step({"a": feed(1, 8), "d": feed(1, 9)}, model)
    full.session.reset("d", source=0, source_len=6)
    assert full.session.requests == ("a", "d")
    full.step({"a": feed(1, 10), "d": feed(1, 11)})


def test_a_model_function_interrupted_by_ctrl_c_commits_nothing_and_starts_nothing(full):
    before = full.snapshot()
    calls = []

    def interrupted(attn, x):
        model(attn, x)
        calls.append(1)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        full.session.step({"a": feed(1, 5), "b": feed(1, 6)}, interrupted)
    assert calls and full.snapshot() == before
    full.session.finish("b")
    full.ref.remove_request("b")
    before = full.snapshot()
    with pytest.raises(KeyboardInterrupt):  # a new request fed to the interrupted step is not started
        full.session.step({"a": feed(1, 5), "n": feed(1, 6)}, interrupted)
    assert full.snapshot() == before
    for s in range(4):
        full.step({"a": feed(1, 7 + s), "n": feed(2, 20 + s)})


def test_step_called_from_inside_the_model_function_is_refused(full):
    before = full.snapshot()

    def reentrant(attn, x):
        full.session.step({"b": feed(1, 0)}, model)

    with pytest.raises(RuntimeError, match=r"step\(\) was called while step\(\) is running in the same thread"):
        full.session.step({"a": feed(1, 5)}, reentrant)
    assert full.snapshot() == before

    def finishing(attn, x):
        full.session.finish("b")

    with pytest.raises(RuntimeError, match=r"finish\(\) was called while step\(\) is running"):
        full.session.step({"a": feed(1, 5)}, finishing)
    assert full.snapshot() == before
    full.step({"a": feed(1, 6), "b": feed(1, 7)})


def test_a_second_thread_stepping_the_same_session_is_refused(full):
    inside, release = threading.Event(), threading.Event()
    errors = []

    def slow(attn, x):
        out = model(attn, x)
        inside.set()
        release.wait(10)
        return out

    def first():
        full.session.step({"a": feed(1, 5), "b": feed(1, 6)}, slow)

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(10)
    try:
        full.session.step({"a": feed(1, 7)}, model)
    except RuntimeError as exc:
        errors.append(str(exc))
    finally:
        release.set()
        thread.join(10)
    assert errors and "from another thread while step() runs; a session is not thread-safe" in errors[0]
    assert full.session.written("a") == 3 and full.session.written("b") == 2  # only the first step ran


def test_a_stateful_model_returning_two_outputs_and_no_state_is_refused():
    s = StreamSession(BoundedKVManager(config(), block_size=8), compile=False, initial_state=lambda: torch.zeros(3))

    def two_outputs(attn, x, state):
        out = model(attn, x)
        return out, out.sum(-1)  # the second output is not the state

    with pytest.raises(ValueError, match=r"new_state shaped like the state it was given .*\[\(2, 3\)\]"):
        s.step({"a": feed(1, 0)}, two_outputs)
    assert s.requests == () and s.cache.free_slots == 2


def test_initial_state_may_depend_on_the_request():
    s = StreamSession(BoundedKVManager(config(), block_size=8), compile=False,
                      initial_state=lambda rid: torch.full((2,), float(len(rid))))

    def keep(attn, x, state):
        return model(attn, x), state

    s.step({"a": feed(1, 0), "bbb": feed(1, 1)}, keep)
    assert s.state("a").tolist() == [1.0, 1.0] and s.state("bbb").tolist() == [3.0, 3.0]


def test_batch_sizes_must_hold_every_lane():
    with pytest.raises(ValueError, match=r"batch_sizes=\[1\] cannot hold every lane: .* must be 2"):
        StreamSession(config(), batch_sizes=(1,), compile=False)
    assert StreamSession(config(), batch_sizes=(1, 2), compile=False).batch_sizes == (1, 2)


def test_a_waiting_request_keeps_its_place_when_starting_it_fails(full):
    """finish() ends its request; if the waiting request's initial_state raises while it is started
    in the freed lane, that error comes out of finish() and the request still waits, first in line."""
    fail = {"d"}

    def initial(rid):
        if rid in fail:
            raise RuntimeError(f"no state for {rid}")
        return torch.zeros(2)

    s = StreamSession(BoundedKVManager(config(), block_size=8), compile=False, initial_state=initial)
    s.start("a")
    s.start("b")
    assert s.start("d") is False
    with pytest.raises(RuntimeError, match="no state for d"):
        s.finish("b")
    assert s.requests == ("a",) and s.waiting == ("d",) and s.free_lanes == 1 and s.cache.free_slots == 1
    fail.clear()
    s.finish("a")  # the next free lane goes to "d"
    assert s.requests == ("d",) and s.waiting == () and s.lane("d") == 0


def test_a_waiting_request_whose_source_returns_starts_again(full):
    """A source removed behind the session's back and registered again: feeding the waiting request no
    longer names the stale reason, and registering it through the session gives it the free lane."""
    index = full.add_source(3, 7)
    assert full.session.start("d", source=index, source_len=3) is False
    k, v = source(3, 7)
    full.session.cache.remove_source(index)
    full.session.finish("b")
    full.ref.remove_request("b")
    assert full.session.cache.add_source(k, v) == index  # behind the session's back again
    full.step({"a": feed(1, 8), "d": feed(1, 9)})  # "d" is fed and still waits
    assert full.session.waiting == ("d",) and full.session.requests == ("a",)
    full.session.cache.remove_source(index)
    assert full.add_source(3, 7) == index  # through the session: the waiting request takes the lane
    assert full.session.requests == ("a", "d") and full.session.waiting == ()
    full.step({"a": feed(1, 10), "d": feed(2, 11)})


def test_a_request_given_a_private_source_is_not_started_without_it(full):
    """A step starts new requests with no source; one holding a private source must start() on it,
    and the refusal keeps its private source."""
    full.session.finish("b")
    full.ref.remove_request("b")
    before = full.snapshot()
    with pytest.raises(ValueError, match=r"request 'c' has a private source but was never started: start\('c', "
                                         r"source=-1"):
        full.session.step({"a": feed(1, 5), "c": feed(1, 6)}, model)
    assert full.snapshot() == before and "c" in full.session.cache.private_sources
    full.session.start("c", source=-1, source_len=4)
    full.step({"a": feed(1, 5), "c": feed(1, 6)})


def test_a_session_needs_a_cache_of_its_own():
    cache = BoundedKVManager(config(), block_size=8)
    cache.admit(BoundedKVStep((Segment("x", 0),), {"x": StreamPosition(0, 0)}))
    with pytest.raises(ValueError, match=r"needs a cache that holds no request .* holds \['x'\]"):
        StreamSession(cache, compile=False)
    assert cache.requests == ("x",)


def host_entries(obj) -> int:
    """Entries of every container reachable from `obj` through flexkv's own objects (tensors are device state,
    counted elsewhere): what a session keeps on the host."""
    from collections import deque

    seen, total, todo = set(), 0, [obj]
    while todo:
        x = todo.pop()
        if id(x) in seen or isinstance(x, torch.Tensor):
            continue
        seen.add(id(x))
        if isinstance(x, dict):
            total += len(x)
            todo.extend(x.keys())
            todo.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset, deque)):
            total += len(x)
            todo.extend(x)
        elif type(x).__module__.startswith("flexkv"):
            todo.extend(getattr(x, "__dict__", {}).values())
            todo.extend(getattr(x, s) for s in getattr(type(x), "__slots__", ()) if hasattr(x, s))
    return total


def test_a_finished_request_leaves_no_host_state_behind():
    """Requests come and go (some wait for a lane, some hold a private source, some are reset): after the
    first round the session's host state no longer grows with the number of requests it has finished."""
    c = Checked()
    c.add_source(6, 1)

    def round_of(r):
        ids = [f"{r}-{i}" for i in range(3)]
        c.add_private_source(ids[2], 4, r)
        c.session.start(ids[0], source=0, source_len=5)
        c.session.start(ids[1])
        assert not c.session.start(ids[2], source=-1, source_len=4)  # both lanes held: it waits
        c.step({ids[0]: feed(2, r), ids[1]: feed(3, r + 1)})
        c.session.reset(ids[1])
        c.ref.reset_request(ids[1])
        c.step({ids[0]: feed(1, r + 2), ids[1]: feed(2, r + 3)})
        c.session.finish(ids[0])  # ids[2] takes its lane
        c.ref.remove_request(ids[0])
        c.step({ids[1]: feed(1, r + 4), ids[2]: feed(3, r + 5)})
        live.append(host_entries(c.session))  # two requests on their lanes
        for rid in ids[1:]:
            c.session.finish(rid)
            c.ref.remove_request(rid)
        c.ref.remove_private_source(ids[2])

    live = []
    round_of(0)
    after_one = host_entries(c.session)
    assert live[0] > after_one  # the count sees what a live request keeps
    for r in range(1, 25):
        round_of(r)
    assert not c.session.requests and not c.session.waiting
    assert host_entries(c.session) == after_one
