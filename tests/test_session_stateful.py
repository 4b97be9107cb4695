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
from random_workload import check_close

from flexkv import (
    BoundedKVConfig,
    BoundedKVManager,
    LayerGroup,
    Recall,
    SinkWindow,
    SlotsExhausted,
    SourcesExhausted,
    StreamSession,
)
from flexkv.cache.paths.attention_options import AttentionOptions
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
    """What the contract says the session holds, and whether an operation is allowed. `configs`: the retention
    of each layer group (a rollback must be exact in every group)."""

    def __init__(self, configs=(CONFIG,)):
        self.configs = configs
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
        L = self.decl[rid][1]
        n = L + w - tokens
        for config in self.configs:
            pol = config.retention_for(L)
            # A Recall memory keeps its whole blocks and the block leaving the window behind the window.
            memory = 0 if not isinstance(pol, Recall) else pol.memory + pol.block - 1
            ring = pol.window + memory + config.max_step_tokens
            ring_start = max(pol.sink, L)
            if not (n <= ring_start or max(ring_start, n - pol.window - memory) >= self.reach[rid] - ring):
                return False
        return True

    def remove(self, rid):
        del self.lanes[rid], self.decl[rid], self.written[rid], self.reach[rid]
        self.private.pop(rid, None)
        for w in list(self.queue):  # lanes go to the waiting requests, in order
            if self.free_lanes():
                self.queue.remove(w)
                self.run(*w)


class SessionMachine(RuleBasedStateMachine):
    #: the cache's layer groups (None: one group with the config's retention)
    groups = None
    config = CONFIG
    #: the attention path the cache takes (`AttentionOptions.path`)
    path = "auto"

    def __init__(self):
        super().__init__()
        config = self.config
        options = AttentionOptions.for_cache(config, "cpu", path=self.path)
        self.session = StreamSession(BoundedKVManager(config, groups=self.groups, block_size=8, options=options),
                                     compile=False)
        self.ref = ReferenceCache(config) if self.groups is None else GroupedReference(config, self.groups)
        self.m = SessionModel(tuple(self.session.cache.layer_config(i) for i in range(LAYERS)))
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
        # What layer 0 wrote stays in the slots, unread (contract section 5): a running request's ring has
        # been written as far as the step reached, which bounds a later rollback as a committed step would.
        T = max(fed.values())  # the session's token buckets here are (1, max_step_tokens=2)
        for rid in fed:
            if rid in m.lanes:
                m.reach[rid] = max(m.reach[rid], m.decl[rid][1] + m.written[rid] + T)


SessionMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_session_against_its_model = SessionMachine.TestCase


class GroupedReference:
    """The dense reference of a cache with layer groups: one `ReferenceCache` per group (its layers, retention
    and query window), each told every lifecycle change, a layer attended in its group's."""

    def __init__(self, config, groups):
        self.groups = groups
        self.refs = [ReferenceCache(config.replace(num_layers=len(g.layers), retention=g.retention,
                                                   query_window=g.query_window)) for g in groups]

    def _route(self, layer):
        return next((g, group.layers.index(layer)) for g, group in enumerate(self.groups) if layer in group.layers)

    def __getattr__(self, name):  # a lifecycle change: every group's reference makes it
        def each(*args):
            for ref in self.refs:
                getattr(ref, name)(*args)
        return each

    def _share(self, t, g):
        return t[list(self.groups[g].layers)]

    def add_source(self, place, k, v):
        for g, ref in enumerate(self.refs):
            ref.add_source(place, self._share(k, g), self._share(v, g))

    def add_private_source(self, rid, k, v):
        for g, ref in enumerate(self.refs):
            ref.add_private_source(rid, self._share(k, g), self._share(v, g))

    def attend(self, layer, q, k, v, step):
        g, i = self._route(layer)
        return self.refs[g].attend(i, q, k, v, step)


class GroupedSessionMachine(SessionMachine):
    """The same program over a cache whose two layers keep different parts of every stream (one slot table, a
    store per group): sources split by layer, forks, rollbacks (exact only where every group's ring allows)
    and failed steps reach every group."""

    groups = (LayerGroup((0,), SinkWindow(1, 4), 4), LayerGroup((1,), SinkWindow(0, 3), 3))


GroupedSessionMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
test_grouped_session_against_its_model = GroupedSessionMachine.TestCase


class RecallSessionMachine(SessionMachine):
    """The same program over a `Recall` cache (no sources: its memory lives in the slot's ring): memories
    fill and move on, forks copy them with their block means, rollbacks are exact only while the memory's
    cells are intact, resets and finishes free them. The source rules are left out."""

    config = CONFIG.replace(retention=Recall(1, 4, 4, block=2, top_k=1), max_source_len=0, max_sources=0)

    def add_source(self, length):  # not rules here: a Recall cache holds no sources
        pass

    remove_source = add_private_source = remove_private_source = add_source


RecallSessionMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=40, deadline=None)
test_recall_session_against_its_model = RecallSessionMachine.TestCase


class RecallFlexSessionMachine(RecallSessionMachine):
    """The same through FlexAttention (eager): each step copies the chosen memory into its rows' regions
    of the layer tensors, which forks, rollbacks and resets never copy or restore."""

    path = "flex"


RecallFlexSessionMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=40, deadline=None)
test_recall_session_through_flexattention_against_its_model = RecallFlexSessionMachine.TestCase


# ---------------------------------------------------------------------------------------------------------------
# MultiCacheSession: the same lifecycle over two caches of their own shape, retention and step length per request;
# the slow cache holds sources (shared and private), the fast one none.

MULTI = {
    "slow": BoundedKVConfig(num_layers=2, num_heads=1, head_dim=4, rows_per_request=1, max_source_len=MAX_SOURCE,
                            max_sources=PLACES, retention=SinkWindow(1, 4), max_slots=SLOTS, max_step_tokens=2,
                            query_window=4, dtype=torch.float64),
    "fast": BoundedKVConfig(num_layers=1, num_heads=2, head_dim=2, rows_per_request=1, max_source_len=0,
                            retention=SinkWindow(0, 3), max_slots=SLOTS, max_step_tokens=4, query_window=3,
                            dtype=torch.float64),
}
RATE = {"slow": 1, "fast": 2}  # tokens each cache takes per step unit of a request
NO_SOURCE = {n: (0, 0) for n in MULTI}


def multi_fn(attn, x):
    """Each cache's stack on its own feed `[B, T, 3, H, D]`: name -> `[B, T, layers, H, D]`."""
    return {name: torch.stack([attn[name](layer, *((x[name][:, :, i] * (layer + 1)).transpose(1, 2)
                                                   for i in range(3))).transpose(1, 2)
                               for layer in range(c.num_layers)], dim=2)
            for name, c in MULTI.items()}


def multi_rollback_ok(config, source_len, written, reach, tokens) -> bool:
    """Contract section 5 in one cache (see `SessionModel.rollback_ok`)."""
    if tokens > written:
        return False
    pol = config.retention_for(source_len)
    ring, ring_start = pol.window + config.max_step_tokens, max(pol.sink, source_len)
    n = source_len + written - tokens
    return tokens == 0 or n <= ring_start or max(ring_start, n - pol.window) >= reach - ring


class MultiCacheMachine(RuleBasedStateMachine):
    """Lanes, the queue, each cache's sources, every request's declarations and each cache's written counts
    and reach, written from the contract; after every operation the session and both caches must agree with
    it, and every step's outputs with a dense reference per cache."""

    def __init__(self):
        super().__init__()
        from flexkv import MultiCacheSession

        self.session = MultiCacheSession({n: BoundedKVManager(c, block_size=8) for n, c in MULTI.items()},
                                         compile=False)
        self.refs = {n: ReferenceCache(c) for n, c in MULTI.items()}
        self.lanes: Dict[str, int] = {}
        self.decl: Dict[str, Dict[str, tuple]] = {}  # running request -> cache -> (source, source_len)
        self.written: Dict[str, Dict[str, int]] = {}
        self.reach: Dict[str, Dict[str, int]] = {}
        self.queue: List[list] = []  # [request, its declarations], first come first served
        self.shared: Dict[str, Dict[int, int]] = {n: {} for n in MULTI}  # cache -> place -> length
        self.private: Dict[str, Dict[str, tuple]] = {n: {} for n in MULTI}  # cache -> request -> (place, length)
        self.seed = 0

    def tensors(self, name, length):
        self.seed += 1
        c, g = MULTI[name], torch.Generator().manual_seed(self.seed)
        shape = (c.num_layers, 1, c.num_heads, length, c.head_dim)
        return torch.randn(*shape, generator=g, dtype=torch.float64), torch.randn(*shape, generator=g,
                                                                                  dtype=torch.float64)

    def waiting(self, rid) -> Optional[list]:
        return next((w for w in self.queue if w[0] == rid), None)

    def free_lanes(self) -> List[int]:
        return [lane for lane in range(SLOTS) if lane not in self.lanes.values()]

    def free_place(self, name) -> Optional[int]:
        used = set(self.shared[name]) | {p for p, _ in self.private[name].values()}
        return next((i for i in range(MULTI[name].max_sources) if i not in used), None)

    def declaration_ok(self, rid, name, source, source_len) -> bool:
        if not 0 <= source_len <= MULTI[name].max_source_len:
            return False
        if source_len == 0:
            return True
        if source == -1:
            return rid in self.private[name] and source_len <= self.private[name][rid][1]
        return source in self.shared[name] and source_len <= self.shared[name][source]

    def run(self, rid, decl):
        self.lanes[rid] = self.free_lanes()[0]
        self.decl[rid] = dict(decl)
        self.written[rid] = {n: 0 for n in MULTI}
        self.reach[rid] = {n: 0 for n in MULTI}

    def observed(self):
        s = self.session
        return (s.requests, {r: (s.lane(r), s.written(r)) for r in s.requests}, s.waiting,
                {r: s.sources(r) for r in s.requests + s.waiting},
                {n: (c.slots.snapshot(), c.sources, c.private_sources) for n, c in s.caches.items()})

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
        assert s.waiting == tuple(w[0] for w in self.queue)
        assert {r: s.sources(r) for r in s.requests + s.waiting} == {
            **{r: self.decl[r] for r in self.lanes}, **{w[0]: w[1] for w in self.queue}}
        for n, c in s.caches.items():  # every cache holds exactly the running requests, each where the model says
            assert sorted(c.requests) == sorted(self.lanes) and c.free_slots == SLOTS - len(self.lanes)
            assert {r: c.written(r) for r in c.requests} == {r: w[n] for r, w in self.written.items()}
            assert c.sources == self.shared[n]
            assert c.private_sources == {r: p for r, (p, _) in self.private[n].items()}

    def pick(self, data, pool):
        pool = sorted(pool)
        return data.draw(st.sampled_from(pool) | st.sampled_from(IDS) if pool else st.sampled_from(IDS))

    @initialize(length=st.integers(1, MAX_SOURCE), reading=st.integers(0, SLOTS - 1), tokens=st.integers(1, 2),
                full=st.booleans(), private=st.sampled_from([None, "given", "started"]))
    def a_voice(self, length, reading, tokens, full, private):
        """Most programs start with a shared source in the slow cache and either requests reading it, on their
        way, one of them forked (the fork reads its parent's source), or every lane held by requests without a
        source and "d" waiting on the source (so remove_source must refuse it); some with "e" given a private
        source, and maybe started on it (running or waiting; remove_private_source must refuse it, and a
        waiting "e" may finish, freeing it)."""
        self.add_source("slow", length)
        if full:
            for rid in IDS[:SLOTS]:
                self.start(rid, None)
            self.start("d", {"slow": (0, length)})
        else:
            for rid in IDS[:reading]:
                self.start(rid, {"slow": (0, length - int(rid == "b"))})  # "b" reads a shorter part of it
        if private:
            self.add_private_source("e", MAX_SOURCE - 1)
        if private == "started":
            self.start("e", {"slow": (-1, MAX_SOURCE - 1)})
        started = self.session.requests + self.session.waiting
        if started:
            self.step({rid: tokens for rid in started})
        if full:
            self.remove_slow_source(0)
        elif reading:
            self.fork_request("a", "c")
        if private == "started":
            self.remove_private_source("e")
            if full and tokens == 2:
                self.finish("e")
        if private == "given":  # refused: "e" must be start()ed on its private source
            self.step({"e": tokens})

    # ------------------------------------------------------------ sources

    @rule(name=st.sampled_from(["slow", "fast", "nope"]), length=st.integers(1, MAX_SOURCE))
    def add_source(self, name, length):
        k, v = self.tensors("fast" if name == "nope" else name, length)
        if name not in MULTI or length > MULTI[name].max_source_len:  # no such cache; a cache without sources
            return self.refused(ValueError, lambda: self.session.add_source(name, k, v))
        place = self.free_place(name)
        if place is None:
            return self.refused(SourcesExhausted, lambda: self.session.add_source(name, k, v))
        assert self.session.add_source(name, k, v) == place
        self.shared[name][place] = length
        self.refs[name].add_source(place, k, v)

    @rule(name=st.sampled_from(["slow", "slow", "fast", "nope"]), data=st.data())
    def remove_source(self, name, data):
        place = data.draw(st.sampled_from(sorted(self.shared.get(name, {})) or [0]) | st.integers(-1, PLACES - 1))
        self.remove_slow_source(place, name)

    def remove_slow_source(self, place, name="slow"):
        call = lambda: self.session.remove_source(name, place)  # noqa: E731
        if name not in MULTI:
            return self.refused(ValueError, call)
        decls = [d[name] for d in self.decl.values()] + [w[1][name] for w in self.queue]
        if place not in self.shared[name] or any(src == place and length for src, length in decls):
            return self.refused(ValueError, call)
        self.session.remove_source(name, place)
        del self.shared[name][place]
        self.refs[name].remove_source(place)

    @rule(rid=st.sampled_from(IDS), length=st.integers(1, MAX_SOURCE))
    def add_private_source(self, rid, length):
        k, v = self.tensors("slow", length)
        call = lambda: self.session.add_private_source("slow", rid, k, v)  # noqa: E731
        if rid in self.private["slow"] or rid in self.lanes:  # a running request's stream has started
            return self.refused(ValueError, call)
        place = self.free_place("slow")
        if place is None:
            return self.refused(SourcesExhausted, call)
        assert call() == place
        self.private["slow"][rid] = (place, length)
        self.refs["slow"].add_private_source(rid, k, v)

    @rule(rid=st.sampled_from(IDS))
    def remove_private_source(self, rid):
        w = self.waiting(rid)
        decl = w[1] if w is not None else self.decl.get(rid, NO_SOURCE)
        if rid not in self.private["slow"] or (decl["slow"][0] == -1 and decl["slow"][1]):
            return self.refused(ValueError, lambda: self.session.remove_private_source("slow", rid))
        self.session.remove_private_source("slow", rid)
        del self.private["slow"][rid]

    # ---------------------------------------------------------- lifecycle

    # Mostly a declaration in the cache with sources; sometimes in the other, or in a cache that does not exist.
    declaration = st.tuples(st.integers(-1, PLACES - 1), st.integers(0, MAX_SOURCE + 1))
    declarations = st.none() | st.fixed_dictionaries({"slow": declaration}) | st.dictionaries(
        st.sampled_from(["slow", "fast", "nope"]), declaration, max_size=2)

    def declared(self, rid, sources, base) -> Optional[dict]:
        """The declarations `sources` makes over `base`, or None when any cache must refuse them."""
        decl = dict(base)
        for name, (src, length) in (sources or {}).items():
            if name not in MULTI or not self.declaration_ok(rid, name, src, length):
                return None
            decl[name] = (src, length)
        return decl

    @rule(rid=st.sampled_from(IDS), sources=declarations)
    def start(self, rid, sources):
        def call():
            return self.session.start(rid) if sources is None else self.session.start(rid, sources=sources)

        decl = self.declared(rid, sources, NO_SOURCE)
        if rid in self.lanes or self.waiting(rid) or decl is None:
            return self.refused(ValueError, call)
        runs = bool(self.free_lanes())
        assert call() is runs
        self.run(rid, decl) if runs else self.queue.append([rid, decl])

    @rule(rid=st.sampled_from(IDS))
    def finish(self, rid):
        w = self.waiting(rid)
        if w is not None:
            self.queue.remove(w)
        elif rid in self.lanes:
            del self.lanes[rid], self.decl[rid], self.written[rid], self.reach[rid]
            for ref in self.refs.values():
                ref.remove_request(rid)
            for w in list(self.queue):  # lanes go to the waiting requests, in order
                if self.free_lanes():
                    self.queue.remove(w)
                    self.run(*w)
        elif not any(rid in p for p in self.private.values()):
            return self.refused(ValueError, lambda: self.session.finish(rid))
        for p in self.private.values():  # its private sources go, in every cache
            p.pop(rid, None)
        self.session.finish(rid)

    @rule(rid=st.sampled_from(IDS), sources=declarations)
    def reset(self, rid, sources):
        w = self.waiting(rid)
        call = lambda: self.session.reset(rid, sources=sources)  # noqa: E731
        if w is None and rid not in self.lanes:
            return self.refused(ValueError, call)
        decl = self.declared(rid, sources, w[1] if w is not None else self.decl[rid])
        if decl is None:
            return self.refused(ValueError, call)
        call()
        if w is not None:
            w[1] = decl
        else:
            self.decl[rid] = decl
            self.written[rid], self.reach[rid] = {n: 0 for n in MULTI}, {n: 0 for n in MULTI}
            for ref in self.refs.values():
                ref.reset_request(rid)

    @rule(data=st.data())
    def fork(self, data):
        rid = self.pick(data, self.lanes)
        self.fork_request(rid, self.pick(data, [r for r in IDS if r not in self.lanes and not self.waiting(r)]))

    def fork_request(self, rid, new):
        call = lambda: self.session.fork(rid, new)  # noqa: E731
        if rid not in self.lanes or new in self.lanes or self.waiting(new):
            return self.refused(ValueError, call)
        if not self.free_lanes():
            return self.refused(SlotsExhausted, call)
        if (self.decl[rid]["slow"][0] == -1 and self.decl[rid]["slow"][1]) or new in self.private["slow"]:
            return self.refused(ValueError, call)  # a private source is its owner's alone
        self.session.fork(rid, new)
        self.lanes[new] = self.free_lanes()[0]
        self.decl[new] = dict(self.decl[rid])  # the fork reads its parent's source
        self.written[new], self.reach[new] = dict(self.written[rid]), dict(self.reach[rid])
        for ref in self.refs.values():
            ref.fork(rid, new)

    @rule(data=st.data())
    def rollback(self, data):
        rid = self.pick(data, self.lanes)
        w = self.written.get(rid, {n: 0 for n in MULTI})
        tokens = {n: data.draw(st.integers(0, w[n] + 1)) for n in MULTI}
        if rid not in self.lanes or not all(
                multi_rollback_ok(MULTI[n], self.decl[rid][n][1], w[n], self.reach[rid][n], tokens[n])
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
        new = [r for r in fed if r not in self.lanes and not self.waiting(r)]
        if any(r in p for r in new for p in self.private.values()):  # given a private source: start() it on it
            return self.refused(ValueError, lambda: self.session.step(feeds, multi_fn))
        for rid in new:  # new requests start without sources, lowest free lane first, in feed order, or wait
            self.run(rid, NO_SOURCE) if self.free_lanes() else self.queue.append([rid, dict(NO_SOURCE)])
        res = self.session.step(feeds, multi_fn)
        running = [r for r in fed if r in self.lanes]
        assert res.lanes == {r: self.lanes[r] for r in running}
        assert sorted(res.waiting) == sorted(r for r in fed if self.waiting(r))
        if not running:
            return
        Ts = self.buckets(fed, running)
        assert {n: res.steps[n].step_tokens for n in MULTI} == Ts
        for n, c in MULTI.items():
            for rid in running:  # each cache's step reads what the request declared there
                pos = res.steps[n].positions[rid]
                assert (pos.source_len, pos.written) == (self.decl[rid][n][1], self.written[rid][n])
                assert not pos.source_len or pos.source == self.decl[rid][n][0]
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
                L = self.decl[rid][n][1]
                self.reach[rid][n] = max(self.reach[rid][n], L + self.written[rid][n] + Ts[n])
                self.written[rid][n] += fed[rid] * RATE[n]

    @rule(fed=st.dictionaries(st.sampled_from(IDS), st.integers(1, 2), min_size=1, max_size=4),
          error=st.sampled_from([None, RuntimeError, KeyboardInterrupt]))
    def failed_step(self, fed, error):
        """The slow cache attends every layer, then the fast cache's attend is given bad input (None) or the
        model raises: neither cache, no lane and no waiting request changes."""
        new = [r for r in fed if r not in self.lanes and not self.waiting(r)]
        if any(self.waiting(r) for r in fed) or len(new) > len(self.free_lanes()) or any(
                r in p for r in new for p in self.private.values()):
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
                L = self.decl[rid][n][1]
                self.reach[rid][n] = max(self.reach[rid][n], L + self.written[rid][n] + Ts[n])


MultiCacheMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
test_multi_cache_session_against_its_model = MultiCacheMachine.TestCase
