"""`MultiCacheSession`: the step loop of a model that keeps several caches.

A streaming speech encoder with two attention stacks at different frame
rates (25 and 50 frames per chunk), each stack with its own cache (its own
`BoundedKVConfig`: layers, heads, retention, `max_step_tokens`), runs each
chunk as one model step over both caches. `MultiCacheSession` is
`StreamSession`'s loop for such a model, over a mapping of named caches,
stepped together through one `flexkv.model.multi_context.MultiStepContext`
(one `flexkv.cache.transaction.StepTransaction` over every cache):

    session = MultiCacheSession({"slow": config_25, "fast": config_50})
    out = session.step({"utt0": {"slow": x25, "fast": x50}}, fn)
    out["utt0"]["fast"]     # fn's "fast" output cut to utt0's lane and tokens

A cache may hold sources: a flow-matching decoder's cache ("dit") reading a
voice prompt shared by every request in that voice, beside two encoder
caches without any:

    voice = session.add_source("dit", prompt_keys, prompt_values)
    session.start("utt1", sources={"dit": (voice, prompt_len)})

What differs from `StreamSession`:

- A feed is, per request, a mapping of cache name -> that cache's feed
  (a tensor or structure of tensors with the tokens along dim 0, or a
  `Chunk`), every cache named: each cache gets its own step length per
  request and its own padded `T` (the smallest of its `token_sizes` that
  holds the step's feeds for it).
- `fn(attn, inputs)`: `attn` is the session's `MultiStepContext`,
  `attn[name]` each cache's `StepContext` (call it, `attn[name](layer, q,
  k, v)`, or build the model's attention on `session.context[name]` with
  `flexkv.model.wrap.attention` / `flexkv.swap_attention`); `inputs` maps
  each cache name to its padded `[B, T_name, ...]` inputs. With
  `initial_state`, `fn(attn, inputs, state)` returns `(outputs,
  new_state)`, as in `StreamSession`.
- A request holds one lane (its batch row, the same in every cache) and one
  slot in every cache; its written count is per cache (`written(id)` maps
  each name to it). Every cache must have the same `max_slots`: a lane
  without a slot in some cache could not run, a slot without a lane would
  never be used.
- Sources live in one cache each, so every source call names its cache:
  `add_source(name, keys, values) -> index`, `remove_source(name, index)`,
  `add_private_source(name, id, keys, values)`,
  `remove_private_source(name, id)` (`StreamSession`'s, with the cache name
  first). A request declares a source per cache when it starts,
  `start(id, sources={name: (source, source_len)})` (`source=-1` its
  private source in that cache); a cache not named starts on an empty
  stream without a source, and `step` starts new requests without any.
  `reset(id, sources={...})` changes the named caches' declarations and
  keeps the others'; `sources(id)` maps every cache to its `(source,
  source_len)`. A waiting request keeps its declarations, and
  `remove_source` / `remove_private_source` refuse a source a waiting
  request declared; `fork` carries every cache's source; `finish` frees
  the request's private sources in every cache.
- `rollback(id, {name: tokens})` names every cache (0 to keep one as it is).

What it keeps: every operation happens in every cache or in none. A step is
one transaction: its admissions (a request admitted in every cache or in
none; a cache that refuses is named), its plans, the attendance check of
every cache's every declared layer, then the commits, so a step that fails
anywhere (bad input, a model error, `KeyboardInterrupt`, a layer never
attended) leaves every cache, lane and waiting request as it was. `finish`,
`reset`, `fork` and `rollback` check every cache first, then change all of
them. Lanes, padding, buckets (`batch_sizes`; `token_sizes` per cache),
queueing (`when_full`), compiling once per bucket (`compile=True`: every
`(B, T of each cache)` at warm-up; a later compile warns with the guard
that failed) and the one-operation-at-a-time rule are `StreamSession`'s: both
sessions keep them in one place, `flexkv.session.lanes.LaneSession`.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, Mapping, Optional, Sequence, Tuple

import torch

from ..cache.groups import build_cache
from ..cache.protocol import check_cache
from ..cache.slots import SlotsExhausted
from ..cache.transaction import StepTransaction
from ..config import BoundedKVConfig, is_int
from ..model.multi_context import MultiStepContext, named_error
from ..step import BoundedKVStep, Segment, StreamPosition
from .feeds import pad_by_lane, parse_feed, unflatten
from .lanes import LaneSession, Waiting, bucket_sizes
from .result import MultiStepResult
from .step_functions import step_key

__all__ = ["MultiCacheSession"]


@contextlib.contextmanager
def _named(name: Hashable, where: str = "MultiCacheSession"):
    """An error raised inside, by cache `name`, raised again with `where` and the cache named."""
    try:
        yield
    except Exception as exc:
        raise named_error(exc, name, where) from None


@dataclass
class _Request:
    """What the session keeps of a started request: its lane and model state. Where its stream stands
    in each cache (source, source length, tokens written) is that cache's to answer (`position`)."""

    lane: int
    state: Any = None


class MultiCacheSession(LaneSession):
    """Streams requests through several named caches stepped as one (see the module docstring).

    Sources live in one cache each: `add_source(cache_name, keys, values)`
    returns the source's index in that cache, and a request reads it with
    `start(request_id, sources={cache_name: (index, source_len)})` (or
    `(-1, source_len)` after `add_private_source(cache_name, request_id,
    keys, values)`); caches not named start without a source.
    `reset(request_id, sources={...})` changes only the caches named;
    `remove_source(cache_name, index)`, `remove_private_source(cache_name,
    request_id)` and `sources(request_id)` complete the set.

    Args:
        caches: a non-empty mapping of name -> `BoundedKVConfig` (the session
            builds a `BoundedKVManager` on `device`) or a flexkv cache of the
            session's own (`flexkv.cache.protocol.StreamCache`, holding no
            request: a `GroupedKVManager` for layer groups, an
            `UncachedHistory` for checking with `compile=False`). Every cache
            needs the same `max_slots`.
        batch_sizes: the batch sizes `B` a step is padded to (default
            `(max_slots,)`; the largest must be `max_slots`).
        token_sizes: name -> the token counts a cache's step is padded to
            (default per cache `(1, max_step_tokens)`); a cache left out
            keeps its default.
        when_full, compile, initial_state: as `StreamSession`.
        block_size: FlexAttention's KV block size of the caches built from configs.
    """

    def __init__(
        self,
        caches: Mapping[Hashable, Any],
        device="cpu",
        *,
        batch_sizes: Optional[Sequence[int]] = None,
        token_sizes: Optional[Mapping[Hashable, Sequence[int]]] = None,
        when_full: str = "queue",
        compile: bool = True,
        initial_state: Optional[Callable[..., Any]] = None,
        block_size: Optional[int] = None,
    ):
        if not isinstance(caches, Mapping) or not caches:
            raise ValueError(f"MultiCacheSession needs a non-empty mapping of name -> BoundedKVConfig or cache, "
                             f"got {caches!r}")
        built = {}
        for name, c in caches.items():
            if isinstance(c, BoundedKVConfig):
                c = build_cache(c, None, device, block_size=block_size)
            check_cache(c, f"MultiCacheSession (cache {name!r})")
            if c.requests:
                raise ValueError(
                    f"MultiCacheSession needs caches that hold no request (the session gives out lanes and slots), "
                    f"but cache {name!r} holds {list(c.requests)}; remove_request() them or give the session a "
                    f"cache of its own"
                )
            if compile is True and not c.compilable:  # (a compile that is not a bool is refused below)
                raise ValueError(f"compile=True needs caches whose attention traces: cache {name!r} "
                                 f"({type(c).__name__}) attends on the host; pass compile=False")
            built[name] = c
        slots = {name: c.config.max_slots for name, c in built.items()}
        if len(set(slots.values())) != 1:
            raise ValueError(
                f"every cache of a MultiCacheSession needs the same max_slots (a request holds one lane and one "
                f"slot in each), got {slots}; give them all max_slots={max(slots.values())}"
            )
        if token_sizes is not None and not isinstance(token_sizes, Mapping):
            raise ValueError(f"token_sizes must be a mapping of cache name -> token sizes, got {token_sizes!r}")
        unknown = [n for n in (token_sizes or {}) if n not in built]
        if unknown:
            raise ValueError(f"token_sizes names {unknown}, which are not caches of this session ({list(built)})")
        super().__init__(next(iter(slots.values())), batch_sizes, when_full, compile, initial_state, "m")
        self.caches: Dict[Hashable, Any] = built
        self.context = MultiStepContext(built)
        self.token_sizes: Dict[Hashable, Tuple[int, ...]] = {}
        for name, c in built.items():
            m = c.config.max_step_tokens
            self.token_sizes[name] = bucket_sizes(f"token_sizes[{name!r}]", (token_sizes or {}).get(name),
                                                  tuple(sorted({1, m})), m, f"cache {name!r}'s max_step_tokens")
        # Every cache starts a request a step starts on an empty stream without a source.
        self._empty_decl = {name: (0, 0) for name in built}
        # Per cache: whether a per-step window attends every token of the step (so padding would be read).
        self._fill_tokens = {
            name: any(c.layer_config(i).query_window is None and not c.layer_config(i).causal_step
                      for i in range(c.config.num_layers))
            for name, c in built.items()
        }

    # ------------------------------------------------------------- views

    def lane(self, request_id: Hashable) -> int:
        """The lane (batch row, the same in every cache) a started request holds."""
        return self._get(request_id).lane

    def written(self, request_id: Hashable) -> Dict[Hashable, int]:
        """Cache name -> the tokens a started request has written to that cache (each cache's record)."""
        self._get(request_id)
        return {name: c.written(request_id) for name, c in self.caches.items()}

    def sources(self, request_id: Hashable) -> Dict[Hashable, Tuple[int, int]]:
        """Cache name -> the `(source, source_len)` a started or waiting request declared in that cache
        (`(0, 0)`: no source)."""
        w = self._waiting(request_id)
        if w is not None:
            return dict(w.decl)
        self._get(request_id)
        return self._declared(request_id)

    def _declared(self, request_id) -> Dict[Hashable, Tuple[int, int]]:
        """Cache name -> the `(source, source_len)` a started request's stream holds in that cache."""
        return {name: (pos.source, pos.source_len)
                for name, pos in ((name, c.position(request_id)) for name, c in self.caches.items())}

    def _cache(self, name, what: str):
        """The cache called `name`, or a `ValueError` naming the caches there are."""
        try:
            known = name in self.caches
        except TypeError:  # unhashable
            known = False
        if not known:
            raise ValueError(f"MultiCacheSession.{what}: no cache {name!r}; this session's caches are "
                             f"{list(self.caches)}")
        return self.caches[name]

    def _declarations(self, sources, what: str, base=None) -> Dict[Hashable, Tuple[int, int]]:
        """Every cache's `(source, source_len)`: those `sources` names, the others' from `base` (an empty
        stream without a source when None). Checks the form only; `_check_start` checks the values."""
        decls = dict(base) if base is not None else {name: (0, 0) for name in self.caches}
        if sources is None:
            return decls
        if not isinstance(sources, Mapping):
            raise ValueError(f"MultiCacheSession.{what}: sources must map a cache name to (source, source_len), "
                             f"e.g. sources={{{next(iter(self.caches))!r}: (0, 4)}}, got {sources!r}")
        for name, decl in sources.items():
            self._cache(name, what)
            if not isinstance(decl, (tuple, list)) or len(decl) != 2:
                raise ValueError(
                    f"MultiCacheSession.{what}: sources[{name!r}] must be a (source, source_len) pair (source: an "
                    f"index add_source() returned, or -1 for the request's private source), got {decl!r}"
                )
            decls[name] = (decl[0], decl[1])
        return decls

    # ----------------------------------------------------------- sources

    def add_source(self, cache_name: Hashable, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Register a shared read-only prefix in cache `cache_name` (that cache's `add_source`: keys and
        values shaped for its layers and heads); returns its index there."""
        with self._exclusive("add_source"):
            c = self._cache(cache_name, "add_source")
            with _named(cache_name, "MultiCacheSession.add_source"):
                index = c.add_source(keys, values)
            self._admit_waiting()  # a waiting request may have been blocked on this source place
            return index

    def remove_source(self, cache_name: Hashable, index: int) -> None:
        """Unregister cache `cache_name`'s shared source `index`; refused while a request reads it, or
        waits to."""
        with self._exclusive("remove_source"):
            c = self._cache(cache_name, "remove_source")
            readers = [w.request_id for w in self._queue.values()
                       if w.decl[cache_name][0] == index and index != -1 and w.decl[cache_name][1]]
            if readers:
                raise ValueError(
                    f"MultiCacheSession.remove_source: source {index} of cache {cache_name!r} is declared by waiting "
                    f"requests {readers}; finish() them or reset() them to another source first"
                )
            with _named(cache_name):
                c.remove_source(index)

    def add_private_source(self, cache_name: Hashable, request_id: Hashable, keys: torch.Tensor,
                           values: torch.Tensor) -> int:
        """Give `request_id` a prefix of its own in cache `cache_name`; then `start(request_id,
        sources={cache_name: (-1, source_len)})`. Freed when the request finishes; a reset keeps it."""
        with self._exclusive("add_private_source"):
            c = self._cache(cache_name, "add_private_source")
            with _named(cache_name):
                return c.add_private_source(request_id, keys, values)

    def remove_private_source(self, cache_name: Hashable, request_id: Hashable) -> None:
        """Free `request_id`'s private source in cache `cache_name`; refused while its stream there
        reads it, or waits to."""
        with self._exclusive("remove_private_source"):
            c = self._cache(cache_name, "remove_private_source")
            w = self._waiting(request_id)
            if w is not None and w.decl[cache_name][0] == -1 and w.decl[cache_name][1]:
                raise ValueError(
                    f"MultiCacheSession.remove_private_source: waiting request {request_id!r} is declared on it in "
                    f"cache {cache_name!r} (source=-1, source_len={w.decl[cache_name][1]}); finish() it or "
                    f"reset() it to another source first"
                )
            with _named(cache_name):
                c.remove_private_source(request_id)

    # --------------------------------------------------------- lifecycle

    def _check_start(self, request_id, decls, restart: bool = False) -> None:
        """Every cache's declaration checks for a request starting on `decls` (name -> (source,
        source_len)), before anything changes; the cache that refuses is named."""
        for name, c in self.caches.items():
            source, source_len = decls[name]
            with _named(name):
                c.check_start(request_id, source, source_len, restart=restart)

    def _admit(self, request_id, decls, transaction: StepTransaction) -> None:
        """Give `request_id` the lowest free lane and a slot in every cache on its declarations `decls`,
        in `transaction` (every cache or none: a cache that refuses is named and the others are taken
        back with it)."""
        state = self._new_request_state(request_id)
        for name, c in self.caches.items():
            source, source_len = decls[name]
            step = BoundedKVStep((Segment(request_id, 0),), {request_id: StreamPosition(source_len, 0, source)})
            try:
                transaction.admit(step, c)
            except SlotsExhausted as exc:
                raise SlotsExhausted(
                    f"cache {name!r} has no free slot for request {request_id!r} ({exc}); it is admitted in no cache"
                ) from exc
            except Exception as exc:
                raise named_error(exc, name, "MultiCacheSession") from None
        self._take_lane(request_id, lambda lane: _Request(lane, state), transaction)

    def _transaction(self) -> StepTransaction:
        """A transaction over every cache (each admission names its cache)."""
        return StepTransaction(next(iter(self.caches.values())))

    def _remove_request(self, request_id) -> None:
        for c in self.caches.values():
            c.remove_request(request_id)  # frees its private source there too

    def start(self, request_id: Hashable, *,
              sources: Optional[Mapping[Hashable, Tuple[int, int]]] = None) -> bool:
        """Start a request in every cache: on `sources[name] = (source, source_len)` in each cache
        named (`source`: an index `add_source(name, ...)` returned, or -1 for the request's private
        source there), on an empty stream without a source in the others. True when it holds a lane
        now, False when it waits (`when_full="queue"`) with its declarations; `when_full="refuse"`
        raises `SlotsExhausted` when every lane is held. Every cache's declaration is checked first,
        whether the request starts or waits; errors change nothing."""
        with self._exclusive("start"):
            return self._start(request_id, self._declarations(sources, "start"))

    def finish(self, request_id: Hashable) -> None:
        """End a request in every cache: its lane and slots go to the first waiting requests that can
        start, and its private sources (in every cache) are freed, also for a request given one and
        never started. If starting a waiting request raises (its `initial_state` fails, an
        interrupt), the finish has happened, the error is raised after it, and that request keeps its
        place in the queue. A waiting request whose declaration no longer holds (its source was
        removed from the cache behind the session's back) keeps its place and does not take the lane;
        `step` says why when it is fed, and `reset` or `finish` fixes it."""
        with self._exclusive("finish"):
            self._finish(request_id)

    def _free_private_sources(self, request_id) -> bool:
        """Free the private sources of a request that holds no slot; whether it had any."""
        owners = [c for c in self.caches.values()
                  if request_id in c.private_sources and request_id not in c.requests]
        for c in owners:
            c.remove_private_source(request_id)
        return bool(owners)

    def reset(self, request_id: Hashable, *,
              sources: Optional[Mapping[Hashable, Tuple[int, int]]] = None) -> None:
        """Rewind a request to an empty stream in every cache (a new model state too), keeping its lane;
        `sources={name: (source, source_len)}` changes the named caches' declarations, the others keep
        theirs (`(0, 0)` drops a cache's source). Every cache's new declaration is checked before any
        changes; a waiting request keeps its place in the queue with the new declarations."""
        with self._exclusive("reset"):
            w = self._waiting(request_id)
            if w is not None:
                self._redeclare_waiting(w, self._declarations(sources, "reset", w.decl))
                return
            req = self._get(request_id)
            decls = self._declarations(sources, "reset", self._declared(request_id))
            self._check_start(request_id, decls, restart=True)
            state = self._new_request_state(request_id)
            for name, c in self.caches.items():
                source, source_len = decls[name]
                c.reset_request(request_id)
                c.admit(BoundedKVStep((Segment(request_id, 0),),
                                      {request_id: StreamPosition(source_len, 0, source)}))
            req.state = state

    def fork(self, request_id: Hashable, new_id: Hashable) -> None:
        """Start `new_id` as a copy of `request_id` in every cache (its slots, written counts and model
        state) on the lowest free lane; refused (`SlotsExhausted`, `ValueError`) with nothing changed
        when any cache refuses."""
        with self._exclusive("fork"):
            parent = self._fork_parent(request_id, new_id)
            for name, c in self.caches.items():
                with _named(name, "MultiCacheSession.fork"):
                    c.check_fork(request_id, new_id)
            state = self._forked_state(parent)
            forked = []
            try:
                for c in self.caches.values():
                    c.fork_request(request_id, new_id)
                    forked.append(c)
            except BaseException:
                for c in forked:  # every cache or none
                    c.remove_request(new_id)
                raise
            self._take_lane(new_id, lambda lane: _Request(lane, state))

    def rollback(self, request_id: Hashable, tokens: Mapping[Hashable, int], *, state=None) -> None:
        """Take back the last `tokens[name]` tokens a started request wrote to each cache (every cache
        named; 0 keeps one as it is). Every cache's `check_rollback` runs first: nothing changes
        unless all of them allow it. With `initial_state`, pass the request's `state` from before those
        tokens (as `StreamSession.rollback`)."""
        with self._exclusive("rollback"):
            req = self._get(request_id)
            if not isinstance(tokens, Mapping) or set(tokens) != set(self.caches):
                raise ValueError(
                    f"rollback: tokens must map every cache name {list(self.caches)} to the tokens to take back "
                    f"from it (0 for none; each cache has its own step lengths), got {tokens!r}"
                )
            for name, c in self.caches.items():
                n = tokens[name]
                if not is_int(n) or n < 0:
                    raise ValueError(f"rollback: tokens[{name!r}] must be an int >= 0, got {n!r}")
                with _named(name, "MultiCacheSession.rollback"):
                    c.check_rollback(request_id, n)
            self._check_rollback_state(request_id, req, any(tokens.values()), state)
            for name, c in self.caches.items():
                c.rollback_request(request_id, tokens[name])
            if state is not None:
                req.state = state

    # -------------------------------------------------------------- steps

    def _parse(self, feeds) -> Dict[Hashable, Dict[Hashable, Any]]:
        if not isinstance(feeds, Mapping) or not feeds:
            raise ValueError("feeds must be a non-empty mapping of request id -> {cache name: tokens (or Chunk)}")
        parsed = {}
        for rid, per_cache in feeds.items():
            if not isinstance(per_cache, Mapping) or set(per_cache) != set(self.caches):
                got = list(per_cache) if isinstance(per_cache, Mapping) else type(per_cache).__name__
                raise ValueError(
                    f"request {rid!r} must feed a mapping with one feed per cache, named {list(self.caches)} (each "
                    f"cache has its own step length), got {got}"
                )
            parsed[rid] = {}
            for name in self.caches:
                try:
                    parsed[rid][name] = parse_feed(rid, per_cache[name], self.token_sizes[name][-1])
                except ValueError as exc:
                    raise ValueError(f"cache {name!r}: {exc}") from None
        first = next(iter(parsed))
        for name in self.caches:
            sig = parsed[first][name].signature
            for rid, feed in parsed.items():
                if feed[name].signature != sig:
                    raise ValueError(
                        f"requests {first!r} and {rid!r} feed cache {name!r} differently shaped inputs; every request "
                        f"of a step must feed each cache the same structure, trailing shapes and dtypes"
                    )
        return parsed

    def step(self, feeds: Mapping[Hashable, Mapping[Hashable, Any]], fn: Callable) -> MultiStepResult:
        """Run one step of `fn` over every cache for the requests in `feeds` (module docstring); returns
        a `MultiStepResult`. Any error, and a `fn` that raises (`KeyboardInterrupt` included), changes
        nothing in any cache."""
        with self._exclusive("step"):
            return self._step(feeds, fn)

    def _step(self, feeds, fn) -> MultiStepResult:
        if not callable(fn):
            raise ValueError(f"fn must be a callable fn(attn, inputs), got {fn!r}")
        parsed = self._parse(feeds)
        self._recheck_blocked(parsed)
        starting, deferred, running, waiting = self._sort_step(parsed, self._check_new)
        if not running:
            for rid in deferred:
                self._enqueue(Waiting(rid, self._empty_decl))
            return MultiStepResult(None, {}, {}, {}, {}, waiting, 0.0)
        Ts = {}
        for name, sizes in self.token_sizes.items():
            T = next(s for s in sizes if s >= max(parsed[r][name].tokens for r in running))
            if self._fill_tokens[name]:
                short = [r for r in running if parsed[r][name].tokens != T]
                if short:
                    raise ValueError(
                        f"request {short[0]!r} feeds cache {name!r} {parsed[short[0]][name].tokens} tokens in a step "
                        f"of T={T}; with a per-step window every query attends all T tokens of its row, so padding "
                        f"would be attended. Feed T tokens (Chunk(inputs, span=k) writes only k), step it "
                        f"separately, or add its length to token_sizes[{name!r}]"
                    )
            Ts[name] = T
        lanes, B = self._lanes(running, starting)
        return self._in_transaction(starting, deferred, lambda transaction: self._run(
            parsed, running, lanes, waiting, B, Ts, fn, transaction))

    def _check_new(self, request_id) -> None:
        """A request a step starts: on empty streams, so not one given a private source in any cache."""
        private = [name for name, c in self.caches.items() if request_id in c.private_sources]
        if private:
            raise ValueError(
                f"request {request_id!r} has a private source in cache {private[0]!r} but was never started: "
                f"start({request_id!r}, sources={{{private[0]!r}: (-1, source_len)}}) it (a step starts new requests "
                f"on empty streams with no source)"
            )
        self._check_start(request_id, self._empty_decl)

    def _run(self, parsed, running, lanes, waiting, B, Ts, fn, transaction) -> MultiStepResult:
        first = parsed[running[0]]
        templates = {name: first[name].leaves for name in self.caches}
        shape = {name: (first[name].spec, first[name].per_request) for name in self.caches}
        key = (step_key(fn), B, tuple(Ts.values()))
        if self.compile and key not in self._warm:
            self._warm_up(fn, templates, shape)
        t0 = time.perf_counter()
        by_lane = {lanes[rid]: rid for rid in running}
        steps = {}
        for name, cache in self.caches.items():
            segments, positions = [], {}
            for lane in range(B):
                rid = by_lane.get(lane)
                if rid is None:
                    segments.append(Segment(None, 0))
                    continue
                segments.append(Segment(rid, parsed[rid][name].span))
                positions[rid] = cache.position(rid)
            steps[name] = BoundedKVStep(tuple(segments), positions, tokens=Ts[name])
        plans = self.context.begin(steps, transaction)
        plan_s = time.perf_counter() - t0
        inputs = {name: unflatten(shape[name][0], pad_by_lane({lanes[r]: parsed[r][name].leaves for r in running},
                                                              templates[name], B, Ts[name], shape[name][1]))
                  for name in self.caches}
        outputs, new_state = self._call(fn, plans, inputs, running, lanes, B, f"B={B}, T={Ts}")
        self._commit(new_state, running, lanes, f"B={B}, T={Ts}")
        return MultiStepResult(outputs, {rid: lanes[rid] for rid in running},
                               {rid: {name: parsed[rid][name].tokens for name in self.caches} for rid in running},
                               steps, plans, waiting, plan_s)

    def warmup(self, fn: Callable, example: Mapping[Hashable, Any]) -> float:
        """Compile `fn` for every bucket (`B`, and a `T` per cache) on all-padding steps; returns the
        seconds it took. `example` is one request's feed (one per cache); `step` does this itself the
        first time it meets `fn` when `compile=True`."""
        with self._exclusive("warmup"):
            parsed = self._parse({None: example})[None]
            templates = {name: parsed[name].leaves for name in self.caches}
            shape = {name: (parsed[name].spec, parsed[name].per_request) for name in self.caches}
            return self._warm_up(fn, templates, shape)

    def _warm_up(self, fn, templates, shape) -> float:
        t0 = time.perf_counter()
        run = self._runner(fn)
        padding_state = self._padding_state()
        names = list(self.caches)
        for B in self.batch_sizes:
            for Ts in itertools.product(*(self.token_sizes[n] for n in names)):
                steps = {n: BoundedKVStep(tuple(Segment(None, 0) for _ in range(B)), {}, tokens=T)
                         for n, T in zip(names, Ts)}
                # Padding alone: it commits nothing a request holds; its commit check refuses a bad graph.
                where = f"MultiCacheSession warm-up of the model step (B={B}, T={dict(zip(names, Ts))})"
                with self.context.stepping(steps, where) as plans:
                    inputs = {n: unflatten(shape[n][0], pad_by_lane({}, templates[n], B, T, shape[n][1]))
                              for n, T in zip(names, Ts)}
                    self._padding_call(run, plans, inputs, B, padding_state)
                self._warm.add((step_key(fn), B, Ts))
        return time.perf_counter() - t0
