"""`StreamSession`: the step loop (see `flexkv.session`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence

import torch

from ..cache.groups import build_cache
from ..cache.protocol import check_cache
from ..cache.transaction import StepTransaction
from ..config import BoundedKVConfig
from ..model.wrap import StepContext
from ..step import BoundedKVStep, Segment, StreamPosition
from .feeds import Chunk, feed_leaves, pad_by_lane, parse_feed, unflatten
from .lanes import WHEN_FULL, LaneSession, Waiting, bucket_sizes
from .result import StepResult
from .step_functions import step_key

__all__ = ["StreamSession", "WHEN_FULL"]


@dataclass
class _Request:
    """What the session keeps of a started request: its lane and model state. Where its stream
    stands (source, source length, tokens written) is the cache's to answer (`cache.position`)."""

    lane: int
    state: Any = None


class StreamSession(LaneSession):
    """Streams requests through a bounded cache: positions, lanes, padding, compile and the step.

    Args:
        cache: a `BoundedKVConfig` (the session builds the cache on
            `device`: a `BoundedKVManager`, or with `groups` a
            `GroupedKVManager`), or any flexkv cache
            (`flexkv.cache.protocol.StreamCache`): a `BoundedKVManager`, a
            `GroupedKVManager`, or an `UncachedHistory` (the same model
            without eviction, for checking; needs `compile=False`).
        groups: with a config, the layer groups that keep their own
            retention: `LayerGroup`s, or one `SinkWindow` per layer.
        device: where a cache built from a config lives.
        batch_sizes: the batch sizes `B` (lanes) a step is padded to; default
            `(max_slots,)`, one batch shape. Each needs its own compile; the
            largest must be `max_slots` (every lane must fit a batch).
        token_sizes: the token counts `T` a step is padded to; default
            `(1, max_step_tokens)`. With a per-step window (`query_window`
            None in some layer) every query attends the step's whole `T`, so
            each feed must hold exactly `T` tokens; with per-query windows or
            causal per-step windows (`causal_step`) in every layer feeds may
            be shorter (queries never see later tokens).
        when_full: ``"queue"`` or ``"refuse"``: what `start` (or a step with a
            new request) does when every lane is held (see `flexkv.session`).
        compile: run `fn` under `torch.compile(fullgraph=True,
            dynamic=False)`, warmed up on every bucket at its first step.
            With False, `fn` runs as given (it may hold compiled parts of its
            own; `attn.plan` is the step's plan).
        initial_state: a callable returning the model state of a new (or
            reset) request: a tensor or tuple/list/dict of tensors. It may
            take the request id (`initial_state(request_id)`) to start
            requests differently. Then `fn` is called `fn(attn, inputs,
            state)` with every request's state stacked by lane (zeros on
            padded lanes) and returns `(outputs, new_state)`, `new_state`
            shaped like `state`; each request keeps `new_state[lane]`.
        block_size: FlexAttention's KV block size of a cache built from a config.
    """

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
        if isinstance(cache, BoundedKVConfig):
            cache = build_cache(cache, groups, device, block_size=block_size)
        elif block_size is not None or groups is not None:
            raise ValueError("block_size and groups are for a cache the session builds from a BoundedKVConfig; "
                             f"this {type(cache).__name__} already has its layout")
        check_cache(cache, "StreamSession")
        c = cache.config
        super().__init__(c.max_slots, batch_sizes, when_full, compile, initial_state, "s")
        if compile and not cache.compilable:
            raise ValueError(f"compile=True needs a cache whose attention traces: this {type(cache).__name__} "
                             f"attends on the host (float64) and is not traceable; pass compile=False")
        if cache.requests:
            raise ValueError(
                f"StreamSession needs a cache that holds no request (the session gives out its lanes and slots), "
                f"but this {type(cache).__name__} holds {list(cache.requests)}; remove_request() them first or give "
                f"the session a cache of its own"
            )
        self.cache = cache
        self.config = c
        self.context = StepContext(cache)
        self.token_sizes = bucket_sizes("token_sizes", token_sizes, tuple(sorted({1, c.max_step_tokens})),
                                        c.max_step_tokens, "max_step_tokens")
        # Whether padding a row's tokens would be attended: a per-step window in some layer
        # attends every token of the step (a causal one never reads a token after the query).
        self._fill_tokens = any(cache.layer_config(i).query_window is None and not cache.layer_config(i).causal_step
                                for i in range(c.num_layers))

    # ------------------------------------------------------------- views

    def written(self, request_id: Hashable) -> int:
        """Tokens a started request has written to its stream (the cache's record of it)."""
        self._get(request_id)
        return self.cache.written(request_id)

    # ----------------------------------------------------------- sources

    def add_source(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Register a shared read-only prefix (see `BoundedKVManager.add_source`); returns its index."""
        with self._exclusive("add_source"):
            index = self.cache.add_source(keys, values)
            self._admit_waiting()  # a waiting request may have been blocked on this source place
            return index

    def remove_source(self, index: int) -> None:
        """Unregister a shared source that no request reads, or waits to read."""
        with self._exclusive("remove_source"):
            readers = [w.request_id for w in self._queue.values() if w.decl[0] == index and index != -1 and w.decl[1]]
            if readers:
                raise ValueError(
                    f"remove_source: source {index} is declared by waiting requests {readers}; finish() them or "
                    f"reset() them to another source first"
                )
            self.cache.remove_source(index)

    def add_private_source(self, request_id: Hashable, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Give `request_id` a prefix of its own (see `BoundedKVManager.add_private_source`); then
        `start(request_id, source=-1, source_len=...)`. It is freed when the request finishes; a reset
        keeps it."""
        with self._exclusive("add_private_source"):
            return self.cache.add_private_source(request_id, keys, values)

    def remove_private_source(self, request_id: Hashable) -> None:
        """Free `request_id`'s private source; refused while its stream reads it, or waits to."""
        with self._exclusive("remove_private_source"):
            w = self._waiting(request_id)
            if w is not None and w.decl[0] == -1 and w.decl[1]:
                raise ValueError(
                    f"remove_private_source: waiting request {request_id!r} is declared on it (source=-1, "
                    f"source_len={w.decl[1]}); finish() it or reset() it to another source first"
                )
            self.cache.remove_private_source(request_id)

    # --------------------------------------------------------- lifecycle

    _empty_decl = (0, 0)  # a request a step starts: an empty stream, no source

    def _check_start(self, request_id, decl, restart: bool = False) -> None:
        """The cache's own declaration checks (the one home of them) of `decl = (source, source_len)`,
        for a request starting now or later."""
        self.cache.check_start(request_id, decl[0], decl[1], restart=restart)

    def _transaction(self) -> StepTransaction:
        return StepTransaction(self.cache)

    def _admit(self, request_id, decl, transaction: StepTransaction) -> None:
        """The cache's slot for a request on `decl = (source, source_len)` (a span-0 step), then the
        lowest free lane, in `transaction` (both taken back if it aborts)."""
        source, source_len = decl
        state = self._new_request_state(request_id)
        transaction.admit(BoundedKVStep((Segment(request_id, 0),), {request_id: StreamPosition(source_len, 0, source)}))
        self._take_lane(request_id, lambda lane: _Request(lane, state), transaction)

    def _remove_request(self, request_id) -> None:
        self.cache.remove_request(request_id)  # frees its private source too

    def _free_private_sources(self, request_id) -> bool:
        """Free the private source of a request that holds no slot; whether it had one."""
        cache = self.cache
        if request_id in cache.private_sources and request_id not in cache.requests:
            cache.remove_private_source(request_id)
            return True
        return False

    def start(self, request_id: Hashable, *, source: int = 0, source_len: int = 0) -> bool:
        """Start a request on an empty stream, optionally after `source_len` entries of source `source`.

        Returns True when it holds a lane now, False when it waits for one
        (`when_full="queue"`); with `when_full="refuse"` a full pool raises
        `SlotsExhausted`. The declaration is checked now, whether the request
        starts or waits; errors change nothing.
        """
        with self._exclusive("start"):
            return self._start(request_id, (source, source_len))

    def finish(self, request_id: Hashable) -> None:
        """End a request: its lane and slot go to the first waiting requests that can start.

        Its private source, if any, is freed (also for a request that was
        given one and never started).

        A waiting request whose declaration no longer holds (its source was
        removed behind the session's back) keeps its place in the queue and
        does not take the lane; `step` says why when it is fed, and `reset`
        or `finish` fixes it.
        """
        with self._exclusive("finish"):
            self._finish(request_id)

    def reset(self, request_id: Hashable, *, source: Optional[int] = None, source_len: Optional[int] = None) -> None:
        """Rewind a request to an empty stream (new state too), keeping its lane; optionally a new source.

        The new declaration is checked before anything changes; a waiting
        request keeps its place in the queue with the new declaration.
        """
        with self._exclusive("reset"):
            w = self._waiting(request_id)
            req = None if w is not None else self._get(request_id)
            if w is not None:
                was = w.decl
            else:
                pos = self.cache.position(request_id)
                was = (pos.source, pos.source_len)
            decl = (was[0] if source is None else source, was[1] if source_len is None else source_len)
            if w is not None:
                self._redeclare_waiting(w, decl)
                return
            self._check_start(request_id, decl, restart=True)
            state = self._new_request_state(request_id)
            src, L = decl
            self.cache.reset_request(request_id)
            self.cache.admit(BoundedKVStep((Segment(request_id, 0),), {request_id: StreamPosition(L, 0, src)}))
            req.state = state

    # ------------------------------------------------- fork and roll back

    def fork(self, request_id: Hashable, new_id: Hashable) -> None:
        """Start `new_id` as a copy of the started request `request_id`: the lowest free lane, a copy of
        its slot (the cache's `fork_request`), its position and source, and a copy of its model state.

        A fork takes a lane now or is refused (`SlotsExhausted`, whatever `when_full` says); a waiting,
        finished or unknown request, an id already in use, and a request reading its private source
        are refused with `ValueError`. Atomic: on any error nothing changes.
        """
        with self._exclusive("fork"):
            parent = self._fork_parent(request_id, new_id)
            self.cache.check_fork(request_id, new_id)
            state = self._forked_state(parent)
            self.cache.fork_request(request_id, new_id)
            self._take_lane(new_id, lambda lane: _Request(lane, state))

    def rollback(self, request_id: Hashable, tokens: int, *, state=None) -> None:
        """Take back the last `tokens` tokens a started request wrote (the cache's `rollback_request`):
        its stream is then as if they had never been fed.

        How many a cache can take back is fixed by its config (`max_rollback`, contract section 5);
        more is refused with `ValueError` and nothing changed. A session with `initial_state` cannot
        undo a model state by itself: pass the request's `state` as it was before those tokens
        (shaped like its current state), or the rollback is refused.
        """
        with self._exclusive("rollback"):
            req = self._get(request_id)
            self.cache.check_rollback(request_id, tokens)
            self._check_rollback_state(request_id, req, bool(tokens), state)
            self.cache.rollback_request(request_id, tokens)
            if state is not None:
                req.state = state

    # -------------------------------------------------------------- steps

    def step(self, feeds: Mapping[Hashable, Any], fn: Callable) -> StepResult:
        """Run one step of `fn` for the requests in `feeds` (see `flexkv.session`); returns a `StepResult`.

        Requests not started yet start here (empty stream, no source). Any
        error is raised before the cache or any request changes, and a `fn`
        that raises (any exception, `KeyboardInterrupt` included) commits
        nothing and starts no request. The session compiles once per step
        function (and bucket): a new function object with the same code and
        the same closure contents (`lambda attn, x: model(x)` written in the
        loop) is the same step; one that captures other values compiles again
        and warns (`RecompileWarning`).
        """
        with self._exclusive("step"):
            return self._step(feeds, fn)

    def _step(self, feeds, fn) -> StepResult:
        if not isinstance(feeds, Mapping) or not feeds:
            raise ValueError("feeds must be a non-empty mapping of request id -> tokens (or Chunk)")
        if not callable(fn):
            raise ValueError(f"fn must be a callable fn(attn, inputs), got {fn!r}")
        parsed = {rid: parse_feed(rid, feed, self.token_sizes[-1]) for rid, feed in feeds.items()}
        sig = None
        for rid, feed in parsed.items():
            s = feed.signature
            if sig is None:
                sig, first = s, rid
            elif s != sig:
                raise ValueError(
                    f"requests {first!r} and {rid!r} feed differently shaped inputs ({sig[1]} vs {s[1]} after the "
                    f"token dim); every request of a step must feed the same structure, trailing shapes and dtypes"
                )
        self._recheck_blocked(parsed)
        starting, deferred, running, waiting = self._sort_step(parsed, self._check_new)
        if not running:
            for rid in deferred:
                self._enqueue(Waiting(rid, self._empty_decl))
            return StepResult(None, {}, {}, None, None, waiting, 0.0)
        T = next(s for s in self.token_sizes if s >= max(parsed[r].tokens for r in running))
        if self._fill_tokens:
            for rid in running:
                if parsed[rid].tokens != T:
                    raise ValueError(
                        f"request {rid!r} feeds {parsed[rid].tokens} tokens in a step of T={T}; with a per-step window "
                        f"every query attends all T tokens of its row, so padding would be attended. Feed T tokens "
                        f"(Chunk(inputs, span=k) writes only k), step it separately, or add its length to token_sizes"
                    )
        lanes, B = self._lanes(running, starting)
        return self._in_transaction(starting, deferred, lambda transaction: self._run(
            parsed, running, lanes, waiting, B, T, fn, transaction))

    def _check_new(self, request_id) -> None:
        """A request a step starts: on an empty stream, so not one given a private source."""
        if request_id in self.cache.private_sources:
            raise ValueError(
                f"request {request_id!r} has a private source but was never started: start({request_id!r}, "
                f"source=-1, source_len=...) it (a step starts new requests on an empty stream with no source)"
            )
        self._check_start(request_id, self._empty_decl)

    def _run(self, parsed, running, lanes, waiting, B, T, fn, transaction: StepTransaction) -> StepResult:
        spec = parsed[running[0]].spec
        template = parsed[running[0]].leaves
        per_request = parsed[running[0]].per_request
        if self.compile and (step_key(fn), B, T) not in self._warm:
            self._warm_up(fn, template, spec, per_request)
        t0 = time.perf_counter()
        by_lane = {lanes[rid]: rid for rid in running}
        segments, positions = [], {}
        for lane in range(B):
            rid = by_lane.get(lane)
            if rid is None:
                segments.append(Segment(None, 0))
                continue
            segments.append(Segment(rid, parsed[rid].span))
            # a request this step starts was admitted on its declaration just now: the cache knows it too
            positions[rid] = self.cache.position(rid)
        step = BoundedKVStep(tuple(segments), positions, tokens=T)
        plan = self.context.begin(step, transaction)
        plan_s = time.perf_counter() - t0
        inputs = unflatten(spec, pad_by_lane({lanes[r]: parsed[r].leaves for r in running}, template, B, T,
                                             per_request))
        outputs, new_state = self._call(fn, plan, inputs, running, lanes, B, f"B={B}, T={T}")

        self._commit(new_state, running, lanes, f"B={B}, T={T}")
        return StepResult(outputs, {rid: lanes[rid] for rid in running},
                          {rid: parsed[rid].tokens for rid in running}, step, plan, waiting, plan_s)

    def warmup(self, fn: Callable, example) -> float:
        """Compile `fn` for every `(B, T)` bucket on all-padding steps (with `compile=False`, run it
        once per bucket); returns the seconds it took.

        `example` is one request's feed (a tensor or structure of tensors with
        any number of tokens, or a `Chunk`): its trailing shapes and dtypes are
        what later steps feed. Padding steps read and write nothing a request
        holds. `step` does this itself the first time it meets `fn` when
        `compile=True`.
        """
        with self._exclusive("warmup"):
            inputs = example.inputs if isinstance(example, Chunk) else example
            template, spec, per_request = feed_leaves(inputs, "warmup's example")
            return self._warm_up(fn, template, spec, per_request)

    def _warm_up(self, fn, template, spec, per_request=()) -> float:
        t0 = time.perf_counter()
        run = self._runner(fn)
        padding_state = self._padding_state()
        for B in self.batch_sizes:
            for T in self.token_sizes:
                step = BoundedKVStep(tuple(Segment(None, 0) for _ in range(B)), {}, tokens=T)
                # A step of padding alone: it reads and writes nothing a request holds. The graph attends
                # what every later step of this shape will, so its commit check refuses a bad one here.
                with self.context.stepping(step, f"StreamSession warm-up of the model step (B={B}, T={T})") as plan:
                    inputs = unflatten(spec, pad_by_lane({}, template, B, T, per_request))
                    self._padding_call(run, plan, inputs, B, padding_state)
                self._warm.add((step_key(fn), B, T))
        return time.perf_counter() - t0
