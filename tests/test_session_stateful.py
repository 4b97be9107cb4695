"""StreamSession as a state machine, against a model of it written from the contract.

`SessionModel` is docs/contract.md section 5 and the session's documented
rules in plain Python: which requests hold which lane, who waits in what
order, which sources and private sources exist, what each request has
written, and which operation must be refused (with which error) because of
all that. Hypothesis drives random programs of starts, steps (with new and
waiting requests fed), finishes, resets, forks, rollbacks and source changes through the
session and the model side by side; after every operation the session's
observable state must equal the model's, every refused operation must have
changed nothing, and every step's outputs must equal the dense reference's.
"""

from typing import Dict, List, Optional

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from flexkv import BoundedKVConfig, BoundedKVManager, SinkWindow, SlotsExhausted, SourcesExhausted, StreamSession
from flexkv.model.random_workload import check_close
from flexkv.model.reference import ReferenceCache

H, D, LAYERS, SLOTS, PLACES, MAX_SOURCE = 1, 4, 2, 3, 2, 4
IDS = ("a", "b", "c", "d", "e")
CONFIG = BoundedKVConfig(num_layers=LAYERS, num_heads=H, head_dim=D, rows_per_request=1, max_source_len=MAX_SOURCE,
                         max_sources=PLACES, retention=SinkWindow(1, 4), max_slots=SLOTS, max_step_tokens=2,
                         query_window=4, dtype=torch.float64)


def model_fn(attn, x):
    """`x [B, T, 3, H, D]` (q, k, v per token) -> `[B, T, LAYERS, H, D]`."""
    return torch.stack([attn(layer, *((x[:, :, i] * (layer + 1)).transpose(1, 2) for i in range(3))).transpose(1, 2)
                        for layer in range(LAYERS)], dim=2)


class SessionModel:
    """What the contract says the session holds, and whether an operation is allowed."""

    def __init__(self):
        self.lanes: Dict[str, int] = {}
        self.decl: Dict[str, tuple] = {}  # running request -> (source, source_len)
        self.written: Dict[str, int] = {}
        self.queue: List[list] = []  # [request, source, source_len], first come first served
        self.shared: Dict[int, int] = {}  # place -> length
        self.private: Dict[str, tuple] = {}  # request -> (place, length)
        # running request -> one past the highest stream index its steps wrote into its slot
        self.reach: Dict[str, int] = {}

    def waiting(self, rid) -> Optional[list]:
        return next((w for w in self.queue if w[0] == rid), None)

    def free_lanes(self) -> List[int]:
        return [lane for lane in range(SLOTS) if lane not in self.lanes.values()]

    def free_place(self) -> Optional[int]:
        used = set(self.shared) | {p for p, _ in self.private.values()}
        return next((i for i in range(PLACES) if i not in used), None)

    def declaration_ok(self, rid, source, source_len) -> bool:
        if not 0 <= source_len <= MAX_SOURCE:
            return False
        if source_len == 0:
            return True
        if source == -1:
            return rid in self.private and source_len <= self.private[rid][1]
        return source in self.shared and source_len <= self.shared[source]

    def run(self, rid, source, source_len):
        self.lanes[rid] = self.free_lanes()[0]
        self.decl[rid] = (source, source_len)
        self.written[rid] = 0
        self.reach[rid] = 0

    def rollback_ok(self, rid, tokens) -> bool:
        """Contract section 5: a rollback is exact while the ring still holds every entry the shorter
        stream reads; the ring keeps window + max(max_step_tokens, max_rollback) cells."""
        w = self.written[rid]
        if tokens > w:
            return False
        if tokens == 0:
            return True
        pol = CONFIG.retention_for(self.decl[rid][1])
        L, ring = self.decl[rid][1], pol.window + CONFIG.max_step_tokens
        n = L + w - tokens
        ring_start = max(pol.sink, L)
        return n <= ring_start or max(ring_start, n - pol.window) >= self.reach[rid] - ring

    def remove(self, rid):
        del self.lanes[rid], self.decl[rid], self.written[rid], self.reach[rid]
        self.private.pop(rid, None)
        for w in list(self.queue):  # lanes go to the waiting requests, in order
            if self.free_lanes():
                self.queue.remove(w)
                self.run(*w)


class SessionMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.session = StreamSession(BoundedKVManager(CONFIG, block_size=8), compile=False)
        self.ref = ReferenceCache(CONFIG)
        self.m = SessionModel()
        self.seed = 0
        self.steps = 0

    def tensors(self, *shape):
        self.seed += 1
        return torch.randn(*shape, generator=torch.Generator().manual_seed(self.seed), dtype=torch.float64)

    def refused(self, error, call):
        """`call()` must raise `error` and change nothing the model tracks."""
        before = self.observed()
        with pytest.raises(error):
            call()
        assert self.observed() == before

    def observed(self):
        s = self.session
        return (s.requests, {r: (s.lane(r), s.written(r)) for r in s.requests}, s.waiting, s.cache.free_slots,
                s.cache.sources, s.cache.private_sources, s.cache.slots.snapshot())

    @invariant()
    def matches_the_model(self):
        s, m = self.session, self.m
        assert s.requests == tuple(sorted(m.lanes, key=m.lanes.get))
        assert {r: (s.lane(r), s.written(r)) for r in s.requests} == {r: (m.lanes[r], m.written[r]) for r in m.lanes}
        assert s.waiting == tuple(w[0] for w in m.queue)
        assert s.cache.free_slots == SLOTS - len(m.lanes)
        assert s.cache.sources == m.shared
        assert s.cache.private_sources == {r: p for r, (p, _) in m.private.items()}

    @initialize(running=st.integers(0, 2), tokens=st.integers(1, 2))
    def some_running(self, running, tokens):
        """Most programs start with requests on their way, so forks and rollbacks meet streams."""
        if running:
            self.step({rid: tokens for rid in IDS[:running]})

    # ------------------------------------------------------------ sources

    @rule(length=st.integers(1, MAX_SOURCE))
    def add_source(self, length):
        k, v = self.tensors(LAYERS, 1, H, length, D), self.tensors(LAYERS, 1, H, length, D)
        place = self.m.free_place()
        if place is None:
            return self.refused(SourcesExhausted, lambda: self.session.add_source(k, v))
        assert self.session.add_source(k, v) == place
        self.m.shared[place] = length
        self.ref.add_source(place, k, v)

    @rule(place=st.integers(0, PLACES - 1))
    def remove_source(self, place):
        m = self.m
        read = any(src == place and length for src, length in m.decl.values()) or any(
            w[1] == place and w[2] for w in m.queue)
        if place not in m.shared or read:
            return self.refused(ValueError, lambda: self.session.remove_source(place))
        self.session.remove_source(place)
        del m.shared[place]

    @rule(rid=st.sampled_from(IDS), length=st.integers(1, MAX_SOURCE))
    def add_private_source(self, rid, length):
        k, v = self.tensors(LAYERS, 1, H, length, D), self.tensors(LAYERS, 1, H, length, D)
        m = self.m
        if rid in m.private or rid in m.lanes:  # a running request's stream has started
            return self.refused(ValueError, lambda: self.session.add_private_source(rid, k, v))
        place = m.free_place()
        if place is None:
            return self.refused(SourcesExhausted, lambda: self.session.add_private_source(rid, k, v))
        self.session.add_private_source(rid, k, v)
        m.private[rid] = (place, length)
        self.ref.add_private_source(rid, k, v)

    @rule(rid=st.sampled_from(IDS))
    def remove_private_source(self, rid):
        m = self.m
        w = m.waiting(rid)
        reading = (w is not None and w[1] == -1 and w[2]) or (rid in m.decl and m.decl[rid][0] == -1 and m.decl[rid][1])
        if rid not in m.private or reading:
            return self.refused(ValueError, lambda: self.session.remove_private_source(rid))
        self.session.remove_private_source(rid)
        del m.private[rid]

    # ---------------------------------------------------------- lifecycle

    @rule(rid=st.sampled_from(IDS), source=st.integers(-1, PLACES - 1), source_len=st.integers(0, MAX_SOURCE + 1))
    def start(self, rid, source, source_len):
        m = self.m
        if rid in m.lanes or m.waiting(rid) or not m.declaration_ok(rid, source, source_len):
            return self.refused(ValueError, lambda: self.session.start(rid, source=source, source_len=source_len))
        runs = bool(m.free_lanes())
        assert self.session.start(rid, source=source, source_len=source_len) is runs
        if runs:
            m.run(rid, source, source_len)
        else:
            m.queue.append([rid, source, source_len])

    @rule(rid=st.sampled_from(IDS))
    def finish(self, rid):
        m = self.m
        w = m.waiting(rid)
        if w is not None:
            m.queue.remove(w)
            m.private.pop(rid, None)
        elif rid in m.lanes:
            m.remove(rid)
            self.ref.remove_request(rid)
        elif rid in m.private:
            del m.private[rid]
        else:
            return self.refused(ValueError, lambda: self.session.finish(rid))
        self.session.finish(rid)

    @rule(rid=st.sampled_from(IDS), source=st.none() | st.integers(-1, PLACES - 1),
          source_len=st.none() | st.integers(0, MAX_SOURCE + 1))
    def reset(self, rid, source, source_len):
        m = self.m
        w = m.waiting(rid)
        if w is None and rid not in m.lanes:
            return self.refused(ValueError, lambda: self.session.reset(rid, source=source, source_len=source_len))
        old = (w[1], w[2]) if w is not None else m.decl[rid]
        new = (old[0] if source is None else source, old[1] if source_len is None else source_len)
        if not m.declaration_ok(rid, *new):
            return self.refused(ValueError, lambda: self.session.reset(rid, source=source, source_len=source_len))
        self.session.reset(rid, source=source, source_len=source_len)
        if w is not None:
            w[1], w[2] = new
        else:
            m.decl[rid], m.written[rid], m.reach[rid] = new, 0, 0
            self.ref.reset_request(rid)

    def pick(self, data, pool):
        """Any id, or (mostly) one of `pool`: rules on running requests then usually hit one."""
        pool = sorted(pool)
        return data.draw(st.sampled_from(pool) | st.sampled_from(IDS) if pool else st.sampled_from(IDS))

    @rule(data=st.data())
    def fork(self, data):
        m = self.m
        rid = self.pick(data, m.lanes)
        new = self.pick(data, [r for r in IDS if r not in m.lanes])
        call = lambda: self.session.fork(rid, new)  # noqa: E731
        if rid not in m.lanes or new in m.lanes or m.waiting(new):
            return self.refused(ValueError, call)
        if not m.free_lanes():
            return self.refused(SlotsExhausted, call)
        if (m.decl[rid][0] == -1 and m.decl[rid][1]) or new in m.private:
            return self.refused(ValueError, call)  # a private source is its owner's alone
        self.session.fork(rid, new)
        m.lanes[new] = m.free_lanes()[0]
        m.decl[new], m.written[new], m.reach[new] = m.decl[rid], m.written[rid], m.reach[rid]
        self.ref.fork(rid, new)

    @rule(data=st.data())
    def rollback(self, data):
        m = self.m
        rid = self.pick(data, m.lanes)
        tokens = data.draw(st.integers(0, m.written.get(rid, 0) + 1))
        if rid not in m.lanes or not m.rollback_ok(rid, tokens):
            return self.refused(ValueError, lambda: self.session.rollback(rid, tokens))
        self.session.rollback(rid, tokens)
        m.written[rid] -= tokens
        self.ref.rollback(rid, m.written[rid])

    @rule(fed=st.dictionaries(st.sampled_from(IDS), st.integers(1, 2), min_size=1, max_size=4))
    def step(self, fed):
        m = self.m
        feeds = {rid: self.tensors(n, 3, H, D) for rid, n in fed.items()}
        new = [r for r in fed if r not in m.lanes and m.waiting(r) is None]
        if any(r in m.private for r in new):  # given a private source: it must be start()ed on it
            self.refused(ValueError, lambda: self.session.step(feeds, model_fn))
            return
        for rid in new:  # new requests start on an empty stream, lowest free lane first, in feed order
            if m.free_lanes():
                m.run(rid, 0, 0)
            else:
                m.queue.append([rid, 0, 0])
        res = self.session.step(feeds, model_fn)
        self.steps += 1
        running = [r for r in fed if r in m.lanes]
        assert sorted(res.lanes) == sorted(running)
        assert sorted(res.waiting) == sorted(r for r in fed if m.waiting(r))
        if not running:
            return
        assert res.lanes == {r: m.lanes[r] for r in running}
        B, T = len(res.step.segments), res.step.step_tokens
        x = torch.zeros(B, T, 3, H, D, dtype=torch.float64)
        for rid in running:
            x[m.lanes[rid], :fed[rid]] = feeds[rid]
        for layer in range(LAYERS):
            q, k, v = ((x[:, :, i] * (layer + 1)).transpose(1, 2) for i in range(3))
            want = self.ref.attend(layer, q, k, v, res.step).transpose(1, 2)
            for rid in running:
                check_close(res[rid][:, layer], want[m.lanes[rid], :fed[rid]], 1e-9,
                            f"session step {self.steps - 1}, layer {layer}, request {rid!r}")
        self.ref.commit(res.step)
        for rid in running:
            L = m.decl[rid][1]
            m.reach[rid] = max(m.reach[rid], L + m.written[rid] + T)  # every own token is written to the slot
            m.written[rid] += fed[rid]

    @rule(fed=st.dictionaries(st.sampled_from(IDS), st.integers(1, 2), min_size=1, max_size=4),
          error=st.sampled_from([RuntimeError, KeyboardInterrupt]))
    def failed_step(self, fed, error):
        """A model function that raises after its first layer attended: the step's transaction takes it
        back whole (new requests not started, nothing committed, the slot table as it was)."""
        m = self.m
        new = [r for r in fed if r not in m.lanes and m.waiting(r) is None]
        if any(m.waiting(r) for r in fed) or any(r in m.private for r in new) or len(new) > len(m.free_lanes()):
            return  # the model function would not run (or not for every fed request): see `step`
        feeds = {rid: self.tensors(n, 3, H, D) for rid, n in fed.items()}

        def failing(attn, x):
            attn(0, *(x[:, :, i].transpose(1, 2) for i in range(3)))
            raise error("the model failed")

        self.refused(error, lambda: self.session.step(feeds, failing))


SessionMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_session_against_its_model = SessionMachine.TestCase


# ---------------------------------------------------------------------------------------------------------------
# MultiCacheSession: the same lifecycle over two caches of their own shape, retention and step length per request.

MULTI = {
    "slow": BoundedKVConfig(num_layers=2, num_heads=1, head_dim=4, rows_per_request=1, max_source_len=0,
                            retention=SinkWindow(1, 4), max_slots=SLOTS, max_step_tokens=2, query_window=4,
                            dtype=torch.float64),
    "fast": BoundedKVConfig(num_layers=1, num_heads=2, head_dim=2, rows_per_request=1, max_source_len=0,
                            retention=SinkWindow(0, 3), max_slots=SLOTS, max_step_tokens=4, query_window=3,
                            dtype=torch.float64),
}
RATE = {"slow": 1, "fast": 2}  # tokens each cache takes per step unit of a request


def multi_fn(attn, x):
    """Each cache's stack on its own feed `[B, T, 3, H, D]`: name -> `[B, T, layers, H, D]`."""
    return {name: torch.stack([attn[name](layer, *((x[name][:, :, i] * (layer + 1)).transpose(1, 2)
                                                   for i in range(3))).transpose(1, 2)
                               for layer in range(c.num_layers)], dim=2)
            for name, c in MULTI.items()}


def multi_rollback_ok(config, written, reach, tokens) -> bool:
    """Contract section 5 for a stream on no source, in one cache (see `SessionModel.rollback_ok`)."""
    if tokens > written:
        return False
    pol = config.retention_for(0)
    n, ring = written - tokens, pol.window + config.max_step_tokens
    return tokens == 0 or n <= pol.sink or max(pol.sink, n - pol.window) >= reach - ring


class MultiCacheMachine(RuleBasedStateMachine):
    """Lanes, the queue and each cache's written counts and reach, written from the contract; after every
    operation the session and both caches must agree with it, and every step's outputs with a dense
    reference per cache."""

    def __init__(self):
        super().__init__()
        from flexkv import MultiCacheSession

        self.session = MultiCacheSession({n: BoundedKVManager(c, block_size=8) for n, c in MULTI.items()},
                                         compile=False)
        self.refs = {n: ReferenceCache(c) for n, c in MULTI.items()}
        self.lanes: Dict[str, int] = {}
        self.written: Dict[str, Dict[str, int]] = {}
        self.reach: Dict[str, Dict[str, int]] = {}
        self.queue: List[str] = []
        self.seed = 0

    def free_lanes(self) -> List[int]:
        return [lane for lane in range(SLOTS) if lane not in self.lanes.values()]

    def run(self, rid):
        self.lanes[rid] = self.free_lanes()[0]
        self.written[rid] = {n: 0 for n in MULTI}
        self.reach[rid] = {n: 0 for n in MULTI}

    def observed(self):
        s = self.session
        return (s.requests, {r: (s.lane(r), s.written(r)) for r in s.requests}, s.waiting,
                {n: c.slots.snapshot() for n, c in s.caches.items()})

    def refused(self, error, call):
        before = self.observed()
        with pytest.raises(error):
            call()
        assert self.observed() == before

    @invariant()
    def matches_the_model(self):
        s = self.session
        assert s.requests == tuple(sorted(self.lanes, key=self.lanes.get))
        assert {r: (s.lane(r), s.written(r)) for r in s.requests} == {
            r: (self.lanes[r], self.written[r]) for r in self.lanes}
        assert s.waiting == tuple(self.queue)
        for n, c in s.caches.items():  # every cache holds exactly the running requests, each where the model says
            assert sorted(c.requests) == sorted(self.lanes) and c.free_slots == SLOTS - len(self.lanes)
            assert {r: c.written(r) for r in c.requests} == {r: w[n] for r, w in self.written.items()}

    def pick(self, data, pool):
        pool = sorted(pool)
        return data.draw(st.sampled_from(pool) | st.sampled_from(IDS) if pool else st.sampled_from(IDS))

    @rule(rid=st.sampled_from(IDS))
    def start(self, rid):
        if rid in self.lanes or rid in self.queue:
            return self.refused(ValueError, lambda: self.session.start(rid))
        runs = bool(self.free_lanes())
        assert self.session.start(rid) is runs
        self.run(rid) if runs else self.queue.append(rid)

    @rule(rid=st.sampled_from(IDS))
    def finish(self, rid):
        if rid in self.queue:
            self.queue.remove(rid)
        elif rid in self.lanes:
            del self.lanes[rid], self.written[rid], self.reach[rid]
            for ref in self.refs.values():
                ref.remove_request(rid)
            while self.queue and self.free_lanes():
                self.run(self.queue.pop(0))
        else:
            return self.refused(ValueError, lambda: self.session.finish(rid))
        self.session.finish(rid)

    @rule(rid=st.sampled_from(IDS))
    def reset(self, rid):
        if rid not in self.lanes and rid not in self.queue:
            return self.refused(ValueError, lambda: self.session.reset(rid))
        self.session.reset(rid)
        if rid in self.lanes:
            self.written[rid], self.reach[rid] = {n: 0 for n in MULTI}, {n: 0 for n in MULTI}
            for ref in self.refs.values():
                ref.reset_request(rid)

    @rule(data=st.data())
    def fork(self, data):
        rid = self.pick(data, self.lanes)
        new = self.pick(data, [r for r in IDS if r not in self.lanes])
        call = lambda: self.session.fork(rid, new)  # noqa: E731
        if rid not in self.lanes or new in self.lanes or new in self.queue:
            return self.refused(ValueError, call)
        if not self.free_lanes():
            return self.refused(SlotsExhausted, call)
        self.session.fork(rid, new)
        self.lanes[new] = self.free_lanes()[0]
        self.written[new], self.reach[new] = dict(self.written[rid]), dict(self.reach[rid])
        for ref in self.refs.values():
            ref.fork(rid, new)

    @rule(data=st.data())
    def rollback(self, data):
        rid = self.pick(data, self.lanes)
        w = self.written.get(rid, {n: 0 for n in MULTI})
        tokens = {n: data.draw(st.integers(0, w[n] + 1)) for n in MULTI}
        if rid not in self.lanes or not all(multi_rollback_ok(MULTI[n], w[n], self.reach[rid][n], tokens[n])
                                            for n in MULTI):
            return self.refused(ValueError, lambda: self.session.rollback(rid, tokens))
        self.session.rollback(rid, tokens)
        for n in MULTI:
            w[n] -= tokens[n]
            self.refs[n].rollback(rid, w[n])

    def feeds(self, fed):
        self.seed += 1
        g = torch.Generator().manual_seed(self.seed)
        return {rid: {n: torch.randn(k * RATE[n], 3, c.num_heads, c.head_dim, generator=g, dtype=torch.float64)
                      for n, c in MULTI.items()} for rid, k in fed.items()}

    def buckets(self, fed, running):
        """Each cache's padded T for the running requests' feeds (token sizes `(1, max_step_tokens)`)."""
        return {n: (1 if max(fed[r] * RATE[n] for r in running) == 1 else c.max_step_tokens) for n, c in MULTI.items()}

    @rule(fed=st.dictionaries(st.sampled_from(IDS), st.integers(1, 2), min_size=1, max_size=4))
    def step(self, fed):
        feeds = self.feeds(fed)
        for rid in fed:  # new requests start, lowest free lane first, in feed order, or wait
            if rid not in self.lanes and rid not in self.queue:
                self.run(rid) if self.free_lanes() else self.queue.append(rid)
        res = self.session.step(feeds, multi_fn)
        running = [r for r in fed if r in self.lanes]
        assert res.lanes == {r: self.lanes[r] for r in running}
        assert sorted(res.waiting) == sorted(r for r in fed if r in self.queue)
        if not running:
            return
        Ts = self.buckets(fed, running)
        assert {n: res.steps[n].step_tokens for n in MULTI} == Ts
        for n, c in MULTI.items():
            x = torch.zeros(len(res.steps[n].segments), Ts[n], 3, c.num_heads, c.head_dim, dtype=torch.float64)
            for rid in running:
                x[self.lanes[rid], :fed[rid] * RATE[n]] = feeds[rid][n]
            for layer in range(c.num_layers):
                q, k, v = ((x[:, :, i] * (layer + 1)).transpose(1, 2) for i in range(3))
                want = self.refs[n].attend(layer, q, k, v, res.steps[n]).transpose(1, 2)
                for rid in running:
                    check_close(res[rid][n][:, layer], want[self.lanes[rid], :fed[rid] * RATE[n]], 1e-9,
                                f"cache {n!r}, layer {layer}, request {rid!r}")
            self.refs[n].commit(res.steps[n])
        for rid in running:
            for n in MULTI:
                self.reach[rid][n] = max(self.reach[rid][n], self.written[rid][n] + Ts[n])
                self.written[rid][n] += fed[rid] * RATE[n]

    @rule(fed=st.dictionaries(st.sampled_from(IDS), st.integers(1, 2), min_size=1, max_size=4),
          error=st.sampled_from([None, RuntimeError, KeyboardInterrupt]))
    def failed_step(self, fed, error):
        """The slow cache attends every layer, then the fast cache's attend is given bad input (None) or the
        model raises: neither cache, no lane and no waiting request changes."""
        new = [r for r in fed if r not in self.lanes and r not in self.queue]
        if any(r in self.queue for r in fed) or len(new) > len(self.free_lanes()):
            return  # the model function would not run for every fed request
        feeds = self.feeds(fed)

        def failing(attn, x):
            for layer in range(MULTI["slow"].num_layers):
                attn["slow"](layer, *(x["slow"][:, :, i].transpose(1, 2) for i in range(3)))
            if error is None:  # the slow cache's head shape in the fast cache
                return attn["fast"](0, *(x["slow"][:, :, i].transpose(1, 2) for i in range(3)))
            raise error("the model failed")

        self.refused(ValueError if error is None else error, lambda: self.session.step(feeds, failing))
        running = [r for r in fed if r in self.lanes]
        Ts = self.buckets(fed, running + new)
        for rid in running:  # a planned step may have written its tokens into the ring (contract section 5)
            for n in MULTI:
                self.reach[rid][n] = max(self.reach[rid][n], self.written[rid][n] + Ts[n])


MultiCacheMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
test_multi_cache_session_against_its_model = MultiCacheMachine.TestCase
