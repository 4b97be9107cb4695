"""`StreamSession`: the step loop over one cache or several named ones (see `flexkv.session`).

Inside, a session over one cache is the one-entry case of a session over
named caches (the one cache is named None). What crosses the door differs,
and that difference is a class chosen once when the session is built
(`StreamSession({...})` builds a `MultiCacheSession`, which overrides a few
methods: `_surface`, `_naming`, `_refused`, ...). A one-cache session's
requests feed tensors and declare `source=`, `source_len=`; one over named caches (`StreamSession({
"slow": ..., "fast": ...})`, or `MultiCacheSession`) takes a feed per cache,
`sources={name: (source, source_len)}`, source calls that name their cache
first, and answers per cache.

A step, top to bottom (`step`): parse the feeds, sort the requests (who
runs, starts, waits: `flexkv.session.lanes.Lanes`), pick each cache's `T`
and the batch bucket `B`, warm up a compiled step the first time, then in
one `StepTransaction`: admit the new requests in every cache, queue the
deferred ones, build and begin every cache's step in the session's
`StepContext`, run the (compiled) model function on the padded inputs, and
commit (the context's one attendance check first). A failure anywhere takes
all of it back.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Mapping, Optional, Sequence, Tuple

import torch

from ..cache.host.transaction import StepTransaction
from ..model.step_context import StepContext
from ..step import BoundedKVStep, Segment, StreamPosition
from .feeds import Chunk, feed_leaves, map_tensors, pad_by_lane, parse_feeds, unflatten
from .lanes import WHEN_FULL, Lanes, OneAtATime, Waiting, declarations, session_caches, source_call
from .result import step_result
from .state import check_new_state, check_rollback_state, lane_states, stack_states, state_factory
from .step_functions import CompiledSteps, step_key

__all__ = ["StreamSession", "WHEN_FULL"]

ONE = None  # the name of a one-cache session's cache


@dataclass
class _Request:
    """What the session keeps of a started request: its lane and model state. Where its stream stands in
    each cache (source, source length, tokens written) is that cache's to answer (`cache.position`)."""

    lane: int
    state: Any = None


class StreamSession:
    """Streams requests through a bounded cache, or several named ones stepped as one: positions, lanes,
    padding, compile and the step (the package docstring, `flexkv.session`, describes it in full).

    Args:
        cache: a `BoundedKVConfig` (the session builds the cache on `device`:
            a `BoundedKVManager`, with `groups` if given), or
            any flexkv cache (`flexkv.cache.protocol.StreamCache`), such as an
            `UncachedHistory` for checking (with `compile=False`); or a
            non-empty mapping of name -> such a config or cache, all with the
            same `max_slots` (`flexkv.session.multi_cache`). Caches of the
            session's own, holding no request.
        groups: with one config, the layer groups that keep their own
            retention: `LayerGroup`s, or one `SinkWindow` per layer.
        device: where a cache built from a config lives.
        batch_sizes: the batch sizes `B` (lanes) a step is padded to; default
            `(max_slots,)`. Each needs its own compile; the largest must be
            `max_slots` (every lane must fit a batch).
        token_sizes: the token counts `T` a step is padded to; default
            `(1, max_step_tokens)` (over named caches: name -> sizes, a cache
            left out keeps its default). With a per-step window in some layer
            (`query_window` None, not `causal_step`) every query attends the
            step's whole `T`, so each feed must hold exactly `T` tokens.
        when_full: ``"queue"`` or ``"refuse"``: what `start` (or a step with a
            new request) does when every lane is held.
        compile: run `fn` under `torch.compile(fullgraph=True, dynamic=False)`,
            warmed up on every bucket at its first step; with False `fn` runs
            as given (`attn.plan` is the step's plan).
        initial_state: a callable returning the model state of a new (or
            reset) request, a tensor or tuple/list/dict of tensors; it may take
            the request id. Then `fn(attn, inputs, state)` gets every request's
            state stacked by lane (zeros on padded lanes) and returns
            `(outputs, new_state)` shaped like it; each request keeps
            `new_state[lane]`.
        block_size: FlexAttention's KV block size of a cache built from a config.
    """

    #: The class of a session over named caches (`flexkv.session.multi_cache.MultiCacheSession`, which names
    #: itself so when it is defined: `flexkv.session` imports it).
    _named_shape: Optional[type] = None

    def __init_subclass__(cls, named_shape: bool = False, **kwargs):
        super().__init_subclass__(**kwargs)
        if named_shape:
            StreamSession._named_shape = cls

    def __new__(cls, cache=None, *args, **kwargs):
        if cls is StreamSession and isinstance(cache, Mapping):
            return super().__new__(StreamSession._named_shape)
        return super().__new__(cls)

    def __init__(
        self,
        cache,
        device="cpu",
        *,
        groups=None,
        batch_sizes: Optional[Sequence[int]] = None,
        token_sizes: Optional[Sequence[int]] = None,
        when_full: str = "queue",
        compile: bool = True,
        initial_state: Optional[Callable[..., Any]] = None,
        block_size: Optional[int] = None,
    ):
        kind = type(self).__name__
        self._check_shape(cache)
        caches, sizes = session_caches(kind, cache, device, groups, block_size, token_sizes, compile)
        if initial_state is not None and not callable(initial_state):
            raise ValueError(f"initial_state must be a callable returning a new request's state, got {initial_state!r}")
        self._lanes = Lanes(next(iter(caches.values())).config.max_slots, batch_sizes, when_full)
        self.caches: Dict[Hashable, Any] = caches
        self.max_slots, self.batch_sizes, self.when_full = self._lanes.max_slots, self._lanes.batch_sizes, when_full
        self.compile, self.initial_state = compile, initial_state
        self._new_state = None if initial_state is None else state_factory(initial_state)
        #: The step context the model's layers read the step from (`fn`'s `attn`).
        self.context = StepContext(self._surface(caches))  # over named caches a `MultiStepContext`
        self._steps = CompiledSteps(self.context, compile, initial_state is not None, kind)
        self._token_sizes: Dict[Hashable, Tuple[int, ...]] = sizes  # name -> the cache's token buckets
        self.token_sizes = self._surface(dict(sizes))
        # Per cache: whether padding a row's tokens would be attended (a per-step window in some layer
        # attends every token of the step; a causal one never reads a token after the query).
        self._fill_tokens = {name: any(c.layer_config(i).query_window is None and not c.layer_config(i).causal_step
                                       for i in range(c.config.num_layers)) for name, c in caches.items()}
        self._empty_decl = {name: (0, 0) for name in caches}  # a request a step starts: empty streams, no source
        self._exclusive = OneAtATime(kind)  # `with self._exclusive("step"):` around every operation

    # ------------------------------------------------------------- views

    @property
    def cache(self):
        """The session's one cache (over named caches, `caches[name]`)."""
        return self.caches[ONE]

    @property
    def config(self):
        """The one cache's `BoundedKVConfig`."""
        return self.cache.config

    @property
    def requests(self) -> tuple:
        """Request ids holding a lane, in lane order."""
        return tuple(sorted(self._lanes.records, key=lambda r: self._lanes.records[r].lane))

    @property
    def waiting(self) -> tuple:
        """Request ids waiting for a lane, first in line first."""
        return tuple(self._lanes.queue)

    @property
    def free_lanes(self) -> int:
        return len(self._lanes.free)

    def lane(self, request_id: Hashable) -> int:
        """The lane (batch row, the same in every cache) a started request holds."""
        return self._lanes.get(request_id).lane

    def state(self, request_id: Hashable):
        """A started request's carried model state (None without `initial_state`)."""
        return self._lanes.get(request_id).state

    def written(self, request_id: Hashable):
        """Tokens a started request has written to its stream (each cache's record; over named caches,
        name -> tokens)."""
        self._lanes.get(request_id)
        written = {name: c.written(request_id) for name, c in self.caches.items()}
        return self._surface(written)

    def sources(self, request_id: Hashable):
        """The `(source, source_len)` a started or waiting request declared (`(0, 0)`: no source; over
        named caches, name -> that cache's)."""
        w = self._lanes.waiting(request_id)
        if w is None:
            self._lanes.get(request_id)
        decls = dict(w.decl) if w is not None else self._declared(request_id)
        return self._surface(decls)

    def _declared(self, request_id) -> Dict[Hashable, Tuple[int, int]]:
        """Cache name -> the `(source, source_len)` a started request's stream holds in that cache."""
        return {name: (pos.source, pos.source_len)
                for name, pos in ((name, c.position(request_id)) for name, c in self.caches.items())}

    # ------------------------------------------------ what differs with the shape (overridden over named caches)

    # A one-cache session's surface: its one cache's values unwrapped (`_surface`), feeds of that cache's
    # tokens, source calls without a cache name. `MultiCacheSession` (what `StreamSession({...})` builds) is the
    # session over named caches and overrides these: the shape is the class, chosen once.

    def _check_shape(self, cache) -> None:
        if isinstance(cache, Mapping):
            raise ValueError(f"{type(self).__name__} takes one cache, got a mapping; StreamSession(...) takes either")

    def _surface(self, per_cache: dict):
        """A name -> value mapping as this session's caller takes it: its one cache's value."""
        return per_cache[ONE]

    def _parse_feeds(self, feeds):
        """request -> cache name -> `Feed` of a step's `feeds`."""
        return parse_feeds(feeds, self._token_sizes, True)

    def _result(self, *args):
        """The step's result (`flexkv.session.result.step_result`'s arguments after the shape)."""
        return step_result(True, *args)

    def _naming(self, name, where: Optional[str] = None):
        """Over named caches, an error raised inside by cache `name` names it, after `where` (`named_error`)."""
        return contextlib.nullcontext()

    def _in_cache(self, name, phrase: str) -> str:
        """`phrase` naming cache `name` (formatted with it) in a message; empty for the one cache."""
        return ""

    def _refused(self, exc: BaseException, name, request_id) -> None:
        """An error cache `name` raised admitting `request_id`: raise it as the caller should see it, or return
        to raise it as it is (one cache: as it is)."""

    def _source_call(self, what: str, args: tuple):
        return source_call(type(self).__name__, True, self.caches, what, args)

    def _declarations(self, what: str, base, source, source_len, sources):
        return declarations(type(self).__name__, what, True, base, source, source_len, sources)

    def _rollback_counts(self, tokens) -> dict:
        """name -> tokens to take back, from `rollback`'s `tokens`."""
        return {ONE: tokens}

    def _templates(self, example) -> dict:
        """name -> `(leaves, spec, per_request)` of `warmup`'s example feed."""
        inputs = example.inputs if isinstance(example, Chunk) else example
        return {ONE: feed_leaves(inputs, "warmup's example")}

    # ----------------------------------------------------------- sources

    def add_source(self, *args) -> int:
        """`add_source(keys, values)`: register a shared read-only prefix (see `BoundedKVManager.add_source`);
        returns its index. Over named caches `add_source(cache_name, keys, values)`: in that cache (keys
        and values shaped for its layers and heads), the index there."""
        with self._exclusive("add_source"):
            name, cache, (keys, values) = self._source_call("add_source", args)
            with self._naming(name, f"{type(self).__name__}.add_source"):
                index = cache.add_source(keys, values)
            self._admit_waiting()  # a waiting request may have been blocked on this source place
            return index

    def remove_source(self, *args) -> None:
        """`remove_source(index)` (over named caches `remove_source(cache_name, index)`): unregister a shared
        source; refused while a request reads it, or waits to."""
        with self._exclusive("remove_source"):
            name, cache, (index,) = self._source_call("remove_source", args)
            readers = [w.request_id for w in self._lanes.queue.values()
                       if w.decl[name][0] == index and index != -1 and w.decl[name][1]]
            if readers:
                raise ValueError(
                    f"{self._in_cache(name, type(self).__name__ + '.')}remove_source: source {index}"
                    f"{self._in_cache(name, ' of cache {!r}')} is declared by waiting requests {readers}; "
                    f"finish() them or reset() them to another source first"
                )
            with self._naming(name):
                cache.remove_source(index)

    def add_private_source(self, *args) -> int:
        """`add_private_source(request_id, keys, values)` (over named caches with `cache_name` first): give
        `request_id` a prefix of its own (see `BoundedKVManager.add_private_source`); then start it on
        it (`source=-1`). It is freed when the request finishes; a reset keeps it."""
        with self._exclusive("add_private_source"):
            name, cache, (request_id, keys, values) = self._source_call("add_private_source", args)
            with self._naming(name):
                return cache.add_private_source(request_id, keys, values)

    def remove_private_source(self, *args) -> None:
        """`remove_private_source(request_id)` (over named caches with `cache_name` first): free
        `request_id`'s private source; refused while its stream reads it, or waits to."""
        with self._exclusive("remove_private_source"):
            name, cache, (request_id,) = self._source_call("remove_private_source", args)
            w = self._lanes.waiting(request_id)
            if w is not None and w.decl[name][0] == -1 and w.decl[name][1]:
                raise ValueError(
                    f"{self._in_cache(name, type(self).__name__ + '.')}remove_private_source: waiting request "
                    f"{request_id!r} is declared on it{self._in_cache(name, ' in cache {!r}')} (source=-1, "
                    f"source_len={w.decl[name][1]}); finish() it or reset() it to another source first"
                )
            with self._naming(name):
                cache.remove_private_source(request_id)

    # --------------------------------------------------------- lifecycle

    def _check_start(self, request_id, decls, restart: bool = False) -> None:
        """Every cache's own declaration checks (the one home of them) for a request starting on `decls`
        (name -> (source, source_len)) now or later; over named caches the cache that refuses is named."""
        for name, c in self.caches.items():
            source, source_len = decls[name]
            with self._naming(name):
                c.check_start(request_id, source, source_len, restart=restart)

    def _admit(self, request_id, decls, transaction: StepTransaction) -> None:
        """A slot in every cache on `decls` (a span-0 step each), then the lowest free lane, in
        `transaction` (all of it taken back if it aborts; a cache that refuses is named)."""
        state = None if self._new_state is None else self._new_state(request_id)
        for name, c in self.caches.items():
            source, source_len = decls[name]
            step = BoundedKVStep((Segment(request_id, 0),), {request_id: StreamPosition(source_len, 0, source)})
            try:
                transaction.admit(step, c)
            except Exception as exc:
                self._refused(exc, name, request_id)
                raise
        self._lanes.take(request_id, lambda lane: _Request(lane, state), transaction)

    def _admit_now(self, request_id, decls) -> None:
        """`_admit` on its own: a transaction that plans nothing, committed when every cache took it."""
        transaction = StepTransaction(next(iter(self.caches.values())))
        try:
            self._admit(request_id, decls, transaction)
        except BaseException:
            transaction.abort()
            raise
        transaction.commit()

    def _admit_waiting(self) -> None:
        """Give free lanes to waiting requests, first come first served, each checked first. One whose
        declaration broke keeps its place and says why when it is fed (`_recheck_blocked`)."""
        for w in list(self._lanes.queue.values()):
            if not self._lanes.free:
                break
            try:
                self._check_start(w.request_id, w.decl)
            except ValueError as exc:
                w.blocked = str(exc)
                continue
            w.blocked = None
            # Admitted first, then out of the queue: if admitting raises (a failing initial_state, an
            # interrupt), the request still waits where it was.
            self._admit_now(w.request_id, w.decl)
            self._lanes.dequeue(w)

    def _free_private_sources(self, request_id) -> bool:
        """Free the private sources of a request that holds no slot; whether it had any."""
        owners = [c for c in self.caches.values() if request_id in c.private_sources and request_id not in c.requests]
        for c in owners:
            c.remove_private_source(request_id)
        return bool(owners)

    def start(self, request_id: Hashable, *, source: int = 0, source_len: int = 0,
              sources: Optional[Mapping[Hashable, Tuple[int, int]]] = None) -> bool:
        """Start a request on an empty stream, optionally after `source_len` entries of source `source`
        (-1: its private source); over named caches, on `sources[name] = (source, source_len)` in each
        cache named and without a source in the others.

        Returns True when it holds a lane now, False when it waits for one
        (`when_full="queue"`); with `when_full="refuse"` a full pool raises
        `SlotsExhausted`. The declaration is checked now, whether the request
        starts or waits; errors change nothing.
        """
        with self._exclusive("start"):
            decls = self._declarations("start", self._empty_decl, source, source_len, sources)
            if self._lanes.known(request_id):
                raise ValueError(f"request {request_id!r} is already started; finish() or reset() it")
            self._check_start(request_id, decls)
            if self._lanes.free:
                self._admit_now(request_id, decls)
                return True
            if self.when_full == "refuse":
                self._lanes.refuse_full(request_id)
            self._lanes.enqueue(Waiting(request_id, decls))
            return False

    def finish(self, request_id: Hashable) -> None:
        """End a request: its lane and slots go to the first waiting requests that can start.

        Its private sources, if any, are freed (also for a request given one and never started). A
        waiting request whose declaration no longer holds (its source was removed behind the session's
        back) keeps its place and does not take the lane; `step` says why when it is fed, and `reset` or
        `finish` fixes it.
        """
        with self._exclusive("finish"):
            w = self._lanes.waiting(request_id)
            if w is not None:
                self._free_private_sources(request_id)
                self._lanes.dequeue(w)
                return
            if request_id not in self._lanes.records and self._free_private_sources(request_id):
                return  # given a private source, never started
            self._lanes.get(request_id)
            for c in self.caches.values():
                c.remove_request(request_id)  # frees its private source there too
            self._lanes.give_back(request_id)
            self._admit_waiting()

    def reset(self, request_id: Hashable, *, source: Optional[int] = None, source_len: Optional[int] = None,
              sources: Optional[Mapping[Hashable, Tuple[int, int]]] = None) -> None:
        """Rewind a request to an empty stream (new state too), keeping its lane; optionally a new source
        (over named caches, `sources={name: (source, source_len)}` changes the named caches'
        declarations and the others keep theirs).

        The new declaration is checked before anything changes; a waiting
        request keeps its place in the queue with the new declaration.
        """
        with self._exclusive("reset"):
            w = self._lanes.waiting(request_id)
            if w is None:
                self._lanes.get(request_id)
            base = w.decl if w is not None else self._declared(request_id)
            decls = self._declarations("reset", base, source, source_len, sources)
            if w is not None:
                self._check_start(request_id, decls)
                w.decl, w.blocked = decls, None
                self._admit_waiting()
                return
            self._check_start(request_id, decls, restart=True)
            state = None if self._new_state is None else self._new_state(request_id)
            for name, c in self.caches.items():
                src, length = decls[name]
                c.reset_request(request_id)
                c.admit(BoundedKVStep((Segment(request_id, 0),), {request_id: StreamPosition(length, 0, src)}))
            self._lanes.records[request_id].state = state

    def fork(self, request_id: Hashable, new_id: Hashable) -> None:
        """Start `new_id` as a copy of the started request `request_id`: the lowest free lane, a copy of
        its slot in every cache (the cache's `fork_request`), its positions and sources, and a copy of
        its model state.

        A fork takes a lane now or is refused (`SlotsExhausted`, whatever `when_full` says); a waiting,
        finished or unknown request, an id already in use, and a request reading its private source
        are refused with `ValueError`. Atomic: on any error nothing changes in any cache.
        """
        with self._exclusive("fork"):
            parent = self._lanes.check_fork(request_id, new_id)
            for name, c in self.caches.items():
                with self._naming(name, f"{type(self).__name__}.fork"):
                    c.check_fork(request_id, new_id)
            state = None if parent.state is None else map_tensors(lambda t: t.clone(), parent.state)
            forked = []
            try:
                for c in self.caches.values():
                    c.fork_request(request_id, new_id)
                    forked.append(c)
            except BaseException:
                for c in forked:  # every cache or none
                    c.remove_request(new_id)
                raise
            self._lanes.take(new_id, lambda lane: _Request(lane, state))

    def rollback(self, request_id: Hashable, tokens, *, state=None) -> None:
        """Take back the last `tokens` tokens a started request wrote (the cache's `rollback_request`): its
        stream is then as if they had never been fed. Over named caches `tokens` maps every cache name
        to the tokens to take back there (0 keeps one as it is).

        How many a cache can take back is fixed by its config (`max_rollback`, contract section 5);
        more is refused with `ValueError` and nothing changed (every cache is checked first). A
        session with `initial_state` cannot undo a model state by itself: pass the request's `state`
        as it was before those tokens (shaped like its current state), or the rollback is refused.
        """
        with self._exclusive("rollback"):
            req = self._lanes.get(request_id)
            counts = self._rollback_counts(tokens)
            for name, c in self.caches.items():
                with self._naming(name, f"{type(self).__name__}.rollback"):
                    c.check_rollback(request_id, counts[name])
            check_rollback_state(request_id, self._new_state is not None, req.state, any(counts.values()), state)
            for name, c in self.caches.items():
                c.rollback_request(request_id, counts[name])
            if state is not None:
                req.state = state

    # -------------------------------------------------------------- steps

    def step(self, feeds: Mapping[Hashable, Any], fn: Callable):
        """Run one step of `fn` for the requests in `feeds` (see `flexkv.session`); returns a `StepResult`
        (over named caches, whose feeds name every cache, a `MultiStepResult`).

        Requests not started yet start here (empty stream, no source). Any error is raised before any
        cache or request changes, and a `fn` that raises (`KeyboardInterrupt` included) commits nothing
        and starts no request. The session compiles once per step function (and bucket): a new function
        with the same code and closure contents (`lambda attn, x: model(x)` written in the loop) is the
        same step; one that captures other values compiles again and warns (`RecompileWarning`).
        """
        with self._exclusive("step"):
            kind, lanes = type(self).__name__, self._lanes
            if not callable(fn):
                raise ValueError(f"fn must be a callable fn(attn, inputs), got {fn!r}")
            parsed = self._parse_feeds(feeds)  # request -> cache name -> Feed
            self._recheck_blocked(parsed)
            new = lanes.new(parsed)
            for rid in new:
                self._check_new(rid)
            starting, deferred, running, waiting = lanes.sort(parsed, new)
            if not running:
                for rid in deferred:
                    lanes.enqueue(Waiting(rid, dict(self._empty_decl)))
                return self._result(None, {}, {}, {}, None, waiting, 0.0)
            # Each cache's T: the smallest of its token sizes that holds every running request's feed.
            Ts = {}
            for name, sizes in self._token_sizes.items():
                Ts[name] = T = next(s for s in sizes if s >= max(parsed[r][name].tokens for r in running))
                short = [r for r in running if parsed[r][name].tokens != T] if self._fill_tokens[name] else []
                if short:
                    raise ValueError(
                        f"request {short[0]!r} feeds {self._in_cache(name, 'cache {!r} ')}"
                        f"{parsed[short[0]][name].tokens} tokens in a step of T={T}; with a per-step window every "
                        f"query attends all T tokens of its row, so padding would be attended. Feed T tokens "
                        f"(Chunk(inputs, span=k) writes only k), step it separately, or add its length to "
                        f"token_sizes{self._in_cache(name, '[{!r}]')}"
                    )
            lane_of, B = lanes.place(running, starting)
            what = f"B={B}, T={self._surface(Ts)}"
            first = parsed[running[0]]
            if self.compile and (step_key(fn), B, tuple(Ts.values())) not in self._steps.warm:
                self._warm_up(fn, {name: (f.leaves, f.spec, f.per_request) for name, f in first.items()})
            # From here on the session changes, in one step transaction: start the new requests, queue the
            # deferred ones, begin every cache's step, run the model, commit. A failure takes all of it back.
            transaction = StepTransaction(next(iter(self.caches.values())))
            try:
                for rid in starting:
                    self._admit(rid, self._empty_decl, transaction)
                for rid in deferred:
                    lanes.enqueue(Waiting(rid, dict(self._empty_decl)), transaction)
                t0 = time.perf_counter()
                by_lane = {lane_of[rid]: rid for rid in running}
                steps = {}
                for name, c in self.caches.items():
                    segments, positions = [], {}
                    for lane in range(B):
                        rid = by_lane.get(lane)
                        if rid is None:
                            segments.append(Segment(None, 0))
                            continue
                        segments.append(Segment(rid, parsed[rid][name].span))
                        positions[rid] = c.position(rid)  # a request this step starts was admitted just now
                    steps[name] = BoundedKVStep(tuple(segments), positions, tokens=Ts[name])
                plans = self.context.begin(self._surface(steps), transaction)
                plan_s = time.perf_counter() - t0
                inputs = {name: unflatten(f.spec, pad_by_lane({lane_of[r]: parsed[r][name].leaves for r in running},
                                                              f.leaves, B, Ts[name], f.per_request))
                          for name, f in first.items()}
                run = self._steps.runner(fn)
                with torch.no_grad(), self._steps.watch(fn, what):
                    args = (plans, self._surface(inputs))
                    if self._new_state is None:
                        outputs, kept = run(*args), {}
                    else:
                        leaves, spec = stack_states({lane_of[r]: lanes.records[r].state for r in running}, B)
                        outputs, new_state = check_new_state(run(*args, unflatten(spec, leaves)), leaves, spec)
                        kept = lane_states(new_state, {rid: lane_of[rid] for rid in running})
                self.context.commit(f"{kind}.step ({what})")  # the attendance check, then every cache's commit
            except BaseException:
                transaction.abort()  # a failed step leaves no request it started
                raise
            for rid, state in kept.items():  # plain assignments, after the commit
                lanes.records[rid].state = state
            return self._result(outputs, {rid: lane_of[rid] for rid in running},
                               {rid: {n: f.tokens for n, f in parsed[rid].items()} for rid in running}, steps, plans,
                               waiting, plan_s)

    def _recheck_blocked(self, fed) -> None:
        """A fed request waiting with a broken declaration: checked again (the reason may be gone), and
        refused with that reason if not."""
        for rid in fed:
            w = self._lanes.waiting(rid)
            if w is not None and w.blocked is not None:
                try:
                    self._check_start(rid, w.decl)
                except ValueError as exc:
                    w.blocked = str(exc)
                    raise ValueError(
                        f"request {rid!r} waits for a lane but can no longer start: {w.blocked}; reset() it with a "
                        f"valid declaration or finish() it"
                    ) from None
                w.blocked = None

    def _check_new(self, request_id) -> None:
        """A request a step starts: on empty streams, so not one given a private source in any cache."""
        private = [name for name, c in self.caches.items() if request_id in c.private_sources]
        if private:
            how = self._in_cache(private[0], "sources={{{!r}: (-1, source_len)}}") or "source=-1, source_len=..."
            where = self._in_cache(private[0], " in cache {!r}")
            raise ValueError(f"request {request_id!r} has a private source{where} "
                             f"but was never started: start({request_id!r}, {how}) it (a step starts new requests "
                             f"{self._in_cache(None, 'on empty streams') or 'on an empty stream'} with no source)")
        self._check_start(request_id, self._empty_decl)

    def warmup(self, fn: Callable, example) -> float:
        """Compile `fn` for every bucket (`B`, and a `T` per cache) on all-padding steps (with
        `compile=False`, run it once per bucket); returns the seconds it took.

        `example` is one request's feed (a tensor or structure of tensors with any number of tokens, or
        a `Chunk`; over named caches one per cache): its trailing shapes and dtypes are what later steps
        feed. Padding steps read and write nothing a request holds. `step` does this itself the first
        time it meets `fn` when `compile=True`.
        """
        with self._exclusive("warmup"):
            return self._warm_up(fn, self._templates(example))

    def _warm_up(self, fn, templates) -> float:
        """Run `fn`'s step on padding alone for every bucket; `templates`: name -> (leaves, spec, per_request)
        of one feed. A padding step commits nothing a request holds; the graph attends what every later
        step of its shape will, so the commit's attendance check refuses a bad one here."""
        t0 = time.perf_counter()
        run = self._steps.runner(fn)
        padding_state = None if self._new_state is None else self._new_state(None)
        names = list(self.caches)
        for B in self.batch_sizes:
            for Ts in itertools.product(*(self._token_sizes[n] for n in names)):
                steps = {n: BoundedKVStep(tuple(Segment(None, 0) for _ in range(B)), {}, tokens=T)
                         for n, T in zip(names, Ts)}
                T_of = self._surface(dict(zip(names, Ts)))
                where = f"{type(self).__name__} warm-up of the model step (B={B}, T={T_of})"
                with self.context.stepping(self._surface(steps), where) as plans:
                    inputs = {n: unflatten(templates[n][1], pad_by_lane({}, templates[n][0], B, T, templates[n][2]))
                              for n, T in zip(names, Ts)}
                    args = (plans, self._surface(inputs))
                    with torch.no_grad():
                        if padding_state is None:
                            run(*args)
                        else:
                            leaves, spec = stack_states({}, B, padding_state)
                            run(*args, unflatten(spec, leaves))
                self._steps.warm.add((step_key(fn), B, Ts))
        return time.perf_counter() - t0

