"""`StreamSession`: the step loop (see `flexkv.session`)."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

import torch

from ..cache.groups import build_cache
from ..cache.manager import SlotsExhausted
from ..cache.protocol import check_cache
from ..cache.transaction import StepTransaction
from ..compiling import RecompileWarning, fresh_function, watch_recompiles
from ..config import BoundedKVConfig, is_int
from ..model.wrap import StepContext
from ..step import BoundedKVStep, Segment, StreamPosition
from .feeds import Chunk, feed_leaves, flatten, map_tensors, pad_by_lane, parse_feed, unflatten
from .result import StepResult
from .state import check_new_state, state_factory
from .step_functions import closure_difference, step_key

__all__ = ["StreamSession", "WHEN_FULL"]

WHEN_FULL = ("queue", "refuse")

_session_ids = itertools.count()

#: What a recompile after warm-up means and what to do, after the guard that failed.
_RECOMPILE_ADVICE = (
    "The session compiles the model step once per (B, T) at warm-up; a later compile means the graph depends "
    "on a Python value that changed between steps, such as an int or flag kept on a module (a position offset "
    "or step counter of a model left in its own streaming or caching mode), a global, or the length of a "
    "Python list. Keep such values out of the step: switch the model's own cache and streaming state off "
    "(flexkv keeps the stream), take positions from the cache (attn.stream_positions()), and pass anything "
    "else that changes per step as a tensor input or buffer. TORCH_LOGS=recompiles logs every recompile."
)


def _sizes(name: str, sizes, default: Tuple[int, ...], hi: int, hi_name: str) -> Tuple[int, ...]:
    if sizes is None:
        return default
    try:
        values = tuple(sizes)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints in [1, {hi_name}={hi}], got {sizes!r}") from None
    if not values or any(not is_int(v) or not 1 <= v <= hi for v in values):
        raise ValueError(f"{name} must be a non-empty sequence of ints in [1, {hi_name}={hi}], got {sizes!r}")
    return tuple(sorted(set(values)))


# ------------------------------------------------------------------ requests


@dataclass
class _Request:
    lane: int
    source: int
    source_len: int
    written: int = 0
    state: Any = None


# ------------------------------------------------------------------ session


@dataclass
class _Waiting:
    request_id: Hashable
    source: int
    source_len: int
    blocked: Optional[str] = None  # why it could not take a lane that freed up (its declaration broke)


class StreamSession:
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
        if when_full not in WHEN_FULL:
            raise ValueError(f"when_full must be one of {WHEN_FULL}, got {when_full!r}")
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be a bool, got {compile!r}")
        if compile and not cache.compilable:
            raise ValueError(f"compile=True needs a cache whose attention traces: this {type(cache).__name__} "
                             f"attends on the host (float64) and is not traceable; pass compile=False")
        if initial_state is not None and not callable(initial_state):
            raise ValueError(f"initial_state must be a callable returning a new request's state, got {initial_state!r}")
        if cache.requests:
            raise ValueError(
                f"StreamSession needs a cache that holds no request (the session gives out its lanes and slots), "
                f"but this {type(cache).__name__} holds {list(cache.requests)}; remove_request() them first or give "
                f"the session a cache of its own"
            )
        c = cache.config
        batch = _sizes("batch_sizes", batch_sizes, (c.max_slots,), c.max_slots, "max_slots")
        if batch[-1] != c.max_slots:
            raise ValueError(
                f"batch_sizes={list(batch)} cannot hold every lane: requests take lanes 0..{c.max_slots - 1} "
                f"(max_slots={c.max_slots}), so the largest batch size must be {c.max_slots}; add it, or lower max_slots"
            )
        self.cache = cache
        self.config = c
        self.context = StepContext(cache)
        self.batch_sizes = batch
        self.token_sizes = _sizes("token_sizes", token_sizes, tuple(sorted({1, c.max_step_tokens})),
                                  c.max_step_tokens, "max_step_tokens")
        self.when_full = when_full
        self.compile = compile
        self.initial_state = initial_state
        self._new_state = None if initial_state is None else state_factory(initial_state)
        # Whether padding a row's tokens would be attended: a per-step window in some layer
        # attends every token of the step (a causal one never reads a token after the query).
        self._fill_tokens = any(cache.layer_config(i).query_window is None and not cache.layer_config(i).causal_step
                                for i in range(c.num_layers))
        self._id = next(_session_ids)
        self._requests: Dict[Hashable, _Request] = {}
        self._free_lanes: List[int] = list(range(c.max_slots))
        self._queue: deque = deque()  # _Waiting, first come first served
        # Keyed on step_key(fn): a new but identical function object (a lambda written in the step loop)
        # is the same step and reuses its compiled graphs.
        self._runners: Dict[Any, Callable] = {}
        self._step_codes: Dict[Any, Any] = {}  # key -> code object of its compiled step (for recompile reports)
        self._warm: set = set()  # (key, B, T) compiled
        self._compiled_code: Dict[Any, Any] = {}  # a step function's code -> the key first compiled with it
        self._guard = threading.Lock()
        self._running: Optional[Tuple[str, int]] = None  # (operation, thread id) while one runs

    # ------------------------------------------------------------- views

    @property
    def requests(self) -> tuple:
        """Request ids holding a lane, in lane order."""
        return tuple(sorted(self._requests, key=lambda r: self._requests[r].lane))

    @property
    def waiting(self) -> tuple:
        """Request ids waiting for a lane, first in line first."""
        return tuple(w.request_id for w in self._queue)

    @property
    def free_lanes(self) -> int:
        return len(self._free_lanes)

    def lane(self, request_id: Hashable) -> int:
        """The lane (batch row) a started request holds."""
        return self._get(request_id).lane

    def written(self, request_id: Hashable) -> int:
        """Tokens a started request has written to its stream."""
        return self._get(request_id).written

    def state(self, request_id: Hashable):
        """A started request's carried model state (None without `initial_state`)."""
        return self._get(request_id).state

    def _get(self, request_id) -> _Request:
        req = self._requests.get(request_id)
        if req is None:
            where = " (it waits for a lane)" if request_id in self.waiting else ""
            raise ValueError(f"request {request_id!r} holds no lane{where}; start() it or feed it to step()")
        return req

    def _waiting(self, request_id) -> Optional[_Waiting]:
        return next((w for w in self._queue if w.request_id == request_id), None)

    @contextlib.contextmanager
    def _exclusive(self, what: str):
        """Run one session operation at a time; refuse re-entrant and concurrent calls, changing nothing."""
        me = threading.get_ident()
        if not self._guard.acquire(blocking=False):
            running, owner = self._running or ("an operation", None)
            if owner == me:
                raise RuntimeError(
                    f"StreamSession.{what}() was called while {running}() is running in the same thread (from "
                    f"inside the model function, or a callback of it); a session runs one operation at a time: "
                    f"call it after {running}() returns. Nothing changed"
                )
            raise RuntimeError(
                f"StreamSession.{what}() was called from another thread while {running}() runs; a session is not "
                f"thread-safe: give each thread a session of its own, or serialise the calls with a lock. "
                f"Nothing changed"
            )
        self._running = (what, me)
        try:
            yield
        finally:
            self._running = None
            self._guard.release()

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
            readers = [w.request_id for w in self._queue if w.source == index and w.source != -1 and w.source_len]
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
            if w is not None and w.source == -1 and w.source_len:
                raise ValueError(
                    f"remove_private_source: waiting request {request_id!r} is declared on it (source=-1, "
                    f"source_len={w.source_len}); finish() it or reset() it to another source first"
                )
            self.cache.remove_private_source(request_id)

    # --------------------------------------------------------- lifecycle

    def _check_start(self, request_id, source, source_len, restart: bool = False) -> None:
        """The cache's own declaration checks (the one home of them), for a request starting now or later."""
        self.cache.check_start(request_id, source, source_len, restart=restart)

    def _admit(self, request_id, source, source_len, transaction: Optional[StepTransaction] = None) -> None:
        """Take the lowest free lane and the cache's slot for a request (admitted with a span-0 step).

        In a step's `transaction`, both are taken back if the step fails."""
        state = None if self._new_state is None else self._new_state(request_id)
        step = BoundedKVStep((Segment(request_id, 0),), {request_id: StreamPosition(source_len, 0, source)})
        if transaction is None:
            self.cache.admit(step)
        else:
            transaction.admit(step)
        lane = self._free_lanes.pop(0)
        self._requests[request_id] = _Request(lane, source, source_len, 0, state)
        if transaction is not None:
            transaction.add_undo(lambda: self._give_back_lane(request_id))

    def _give_back_lane(self, request_id) -> None:
        """Undo of `_admit` in a failed step: the request leaves its lane (the cache's undo frees its slot)."""
        self._free_lanes.append(self._requests.pop(request_id).lane)
        self._free_lanes.sort()

    def start(self, request_id: Hashable, *, source: int = 0, source_len: int = 0) -> bool:
        """Start a request on an empty stream, optionally after `source_len` entries of source `source`.

        Returns True when it holds a lane now, False when it waits for one
        (`when_full="queue"`); with `when_full="refuse"` a full pool raises
        `SlotsExhausted`. The declaration is checked now, whether the request
        starts or waits; errors change nothing.
        """
        with self._exclusive("start"):
            if request_id in self._requests or self._waiting(request_id) is not None:
                raise ValueError(f"request {request_id!r} is already started; finish() or reset() it")
            self._check_start(request_id, source, source_len)
            if self._free_lanes:
                self._admit(request_id, source, source_len)
                return True
            if self.when_full == "refuse":
                raise SlotsExhausted(
                    f"all {self.config.max_slots} lanes are held, so request {request_id!r} cannot start; finish() a "
                    f"request first, raise max_slots, or use when_full='queue'"
                )
            self._queue.append(_Waiting(request_id, source, source_len))
            return False

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
            w = self._waiting(request_id)
            if w is not None:
                if request_id in self.cache.private_sources:
                    self.cache.remove_private_source(request_id)
                self._queue.remove(w)
                return
            if request_id not in self._requests and request_id in self.cache.private_sources \
                    and request_id not in self.cache.requests:
                self.cache.remove_private_source(request_id)  # given a private source, never started
                return
            req = self._get(request_id)
            self.cache.remove_request(request_id)
            del self._requests[request_id]
            self._free_lanes.append(req.lane)
            self._free_lanes.sort()
            self._admit_waiting()

    def _admit_waiting(self) -> None:
        """Give free lanes to waiting requests, first come first served, each checked first."""
        for w in list(self._queue):
            if not self._free_lanes:
                break
            try:
                self._check_start(w.request_id, w.source, w.source_len)
            except ValueError as exc:
                w.blocked = str(exc)
                continue
            w.blocked = None
            # Admitted first, then out of the queue: if admitting raises (a failing initial_state, an
            # interrupt), the request still waits where it was.
            self._admit(w.request_id, w.source, w.source_len)
            self._queue.remove(w)

    def reset(self, request_id: Hashable, *, source: Optional[int] = None, source_len: Optional[int] = None) -> None:
        """Rewind a request to an empty stream (new state too), keeping its lane; optionally a new source.

        The new declaration is checked before anything changes; a waiting
        request keeps its place in the queue with the new declaration.
        """
        with self._exclusive("reset"):
            w = self._waiting(request_id)
            if w is not None:
                src = w.source if source is None else source
                L = w.source_len if source_len is None else source_len
                self._check_start(request_id, src, L)
                w.source, w.source_len, w.blocked = src, L, None
                self._admit_waiting()
                return
            req = self._get(request_id)
            src = req.source if source is None else source
            L = req.source_len if source_len is None else source_len
            self._check_start(request_id, src, L, restart=True)
            state = None if self._new_state is None else self._new_state(request_id)
            self.cache.reset_request(request_id)
            self.cache.admit(BoundedKVStep((Segment(request_id, 0),), {request_id: StreamPosition(L, 0, src)}))
            req.source, req.source_len, req.written, req.state = src, L, 0, state

    # ------------------------------------------------- fork and roll back

    def fork(self, request_id: Hashable, new_id: Hashable) -> None:
        """Start `new_id` as a copy of the started request `request_id`: the lowest free lane, a copy of
        its slot (the cache's `fork_request`), its position and source, and a copy of its model state.

        A fork takes a lane now or is refused (`SlotsExhausted`, whatever `when_full` says); a waiting,
        finished or unknown request, an id already in use, and a request reading its private source
        are refused with `ValueError`. Atomic: on any error nothing changes.
        """
        with self._exclusive("fork"):
            parent = self._get(request_id)
            if new_id in self._requests or self._waiting(new_id) is not None:
                raise ValueError(f"fork: request {new_id!r} is already started; finish() it or pick another id")
            if not self._free_lanes:
                raise SlotsExhausted(
                    f"fork: all {self.config.max_slots} lanes are held, so {new_id!r} cannot start as a copy of "
                    f"{request_id!r} (a fork copies the stream now and cannot wait); finish() a request first or "
                    f"raise max_slots"
                )
            self.cache.check_fork(request_id, new_id)
            state = None if parent.state is None else map_tensors(lambda t: t.clone(), parent.state)
            self.cache.fork_request(request_id, new_id)
            lane = self._free_lanes.pop(0)
            self._requests[new_id] = _Request(lane, parent.source, parent.source_len, parent.written, state)

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
            if state is not None and self._new_state is None:
                raise ValueError("rollback: state= is for a session with initial_state; this one carries none")
            if state is None and self._new_state is not None and tokens:
                raise ValueError(
                    f"rollback: request {request_id!r} carries a model state (initial_state), which the session "
                    f"cannot take back by itself; pass rollback({request_id!r}, {tokens}, state=...) with its "
                    f"state from before those tokens"
                )
            if state is not None:
                leaves, spec = flatten(state, "rollback's state")
                have, have_spec = flatten(req.state, f"the state of request {request_id!r}")
                if spec != have_spec or [(t.shape, t.dtype) for t in leaves] != [(t.shape, t.dtype) for t in have]:
                    raise ValueError(
                        f"rollback: state must be shaped like request {request_id!r}'s state "
                        f"({[tuple(t.shape) for t in have]}), got {[tuple(t.shape) for t in leaves]}"
                    )
            self.cache.rollback_request(request_id, tokens)
            req.written -= tokens
            if state is not None:
                req.state = state

    # -------------------------------------------------------------- steps

    def _runner(self, fn: Callable) -> Callable:
        key = step_key(fn)
        run = self._runners.get(key)
        if run is not None:
            return run
        context = self.context
        if self.initial_state is None:
            def session_step(plan, inputs):
                context.bind(plan)  # inside the graph: the plan is an input, not a guard
                return fn(context, inputs)
        else:
            def session_step(plan, inputs, state):
                context.bind(plan)
                return fn(context, inputs, state)
        if self.compile:
            # A code object of its own: compiled graphs are cached per code object, and another
            # session's (or another fn's) entries must not be walked or evicted by this one.
            fresh = fresh_function(session_step, f"s{self._id}_{len(self._runners)}")
            self._step_codes[key] = fresh.__code__
            session_step = torch.compile(fresh, fullgraph=True, dynamic=False)
            self._warn_if_compiled_before(fn)
        self._runners[key] = session_step
        return session_step

    def _warn_if_compiled_before(self, fn: Callable) -> None:
        """Say so when a step function of the same code, with other closure values, compiles again."""
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is None:
            return
        key = step_key(fn)
        first_key = self._compiled_code.setdefault(code, key)
        if first_key == key:
            return
        differ = closure_difference(fn, key, first_key)
        warnings.warn(
            f"StreamSession.step: fn {getattr(code, 'co_name', fn)!r} ({code.co_filename}:{code.co_firstlineno}) is "
            f"a new function with the code of one compiled before but other values"
            f"{f' ({differ})' if differ else ''}, so the model step compiles again (seconds per compile, every "
            f"time such a function is made). Define the step function once, outside the step loop, and pass "
            f"what changes per step as an input (a tensor in the feed) or a buffer",
            RecompileWarning, stacklevel=7,
        )

    def _watch_recompiles(self, fn, B: int, T: int):
        """Around a warmed-up compiled step: say which guard failed if it compiles again."""
        if not self.compile:
            return contextlib.nullcontext()
        return watch_recompiles(self._step_codes[step_key(fn)], f"StreamSession.step: the compiled model step (B={B}, T={T})",
                                _RECOMPILE_ADVICE, stacklevel=6)  # the caller of step()

    def _bucket(self, sizes, need: int) -> int:
        return next(s for s in sizes if s >= need)

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
        for rid in parsed:
            w = self._waiting(rid)
            if w is not None and w.blocked is not None:
                try:  # the reason may be gone (its source registered again)
                    self._check_start(rid, w.source, w.source_len)
                except ValueError as exc:
                    w.blocked = str(exc)
                    raise ValueError(
                        f"request {rid!r} waits for a lane but can no longer start: {w.blocked}; reset() it with a "
                        f"valid source or finish() it"
                    ) from None
                w.blocked = None
        # Who runs: started requests, then new ones while lanes are free (in feed order).
        queued = set(self.waiting)
        new = [rid for rid in parsed if rid not in self._requests and rid not in queued]
        private = self.cache.private_sources
        for rid in new:
            if rid in private:
                raise ValueError(
                    f"request {rid!r} has a private source but was never started: start({rid!r}, source=-1, "
                    f"source_len=...) it (a step starts new requests on an empty stream with no source)"
                )
            self._check_start(rid, 0, 0)
        free = len(self._free_lanes)
        if len(new) > free and self.when_full == "refuse":
            raise SlotsExhausted(
                f"the step starts {len(new)} new request(s) but only {free} of {self.config.max_slots} lanes are "
                f"free; finish() requests first, raise max_slots, or use when_full='queue'"
            )
        starting, deferred = new[:free], new[free:]
        running = [rid for rid in parsed if rid in self._requests or rid in starting]
        waiting = tuple(rid for rid in parsed if rid in queued or rid in deferred)
        if not running:
            for rid in deferred:
                self._queue.append(_Waiting(rid, 0, 0))
            return StepResult(None, {}, {}, None, None, waiting, 0.0)
        T = self._bucket(self.token_sizes, max(parsed[r].tokens for r in running))
        if self._fill_tokens:
            for rid in running:
                if parsed[rid].tokens != T:
                    raise ValueError(
                        f"request {rid!r} feeds {parsed[rid].tokens} tokens in a step of T={T}; with a per-step window "
                        f"every query attends all T tokens of its row, so padding would be attended. Feed T tokens "
                        f"(Chunk(inputs, span=k) writes only k), step it separately, or add its length to token_sizes"
                    )
        # Lanes the new requests will take: the lowest free ones, in feed order.
        lanes = {rid: self._requests[rid].lane for rid in running if rid in self._requests}
        for rid, lane in zip(starting, self._free_lanes):
            lanes[rid] = lane
        B = self._bucket(self.batch_sizes, max(lanes.values()) + 1)

        # From here on the session changes, in one step transaction: start the new requests, queue
        # the deferred ones, then run the step. A failure anywhere takes all of it back.
        transaction = StepTransaction(self.cache)
        try:
            for rid in starting:
                self._admit(rid, 0, 0, transaction)
            for rid in deferred:
                w = _Waiting(rid, 0, 0)
                self._queue.append(w)
                transaction.add_undo(lambda w=w: self._queue.remove(w))
            return self._run(parsed, running, lanes, waiting, B, T, fn, transaction)
        except BaseException:
            transaction.abort()  # a failed step leaves no request it started
            raise

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
            req = self._requests[rid]
            segments.append(Segment(rid, parsed[rid].span))
            positions[rid] = StreamPosition(req.source_len, req.written, req.source)
        step = BoundedKVStep(tuple(segments), positions, tokens=T)
        plan = self.context.begin(step, transaction)
        plan_s = time.perf_counter() - t0
        inputs = unflatten(spec, pad_by_lane({lanes[r]: parsed[r].leaves for r in running}, template, B, T,
                                             per_request))
        run = self._runner(fn)
        with torch.no_grad(), self._watch_recompiles(fn, B, T):
            if self.initial_state is None:
                outputs = run(plan, inputs)
            else:
                states = {lanes[r]: flatten(self._requests[r].state, f"the state of request {r!r}") for r in running}
                s_leaves, s_spec = states[lanes[running[0]]]
                stacked = pad_by_lane({l: lv for l, (lv, _) in states.items()}, s_leaves, B, None)
                outputs, new_state = check_new_state(run(plan, inputs, unflatten(s_spec, stacked)),
                                                           stacked, s_spec)
        # Everything that can fail comes before the commit; after it, only plain assignments.
        self.context.check_attendance(f"StreamSession.step (B={B}, T={T})")
        kept = {}
        if self.initial_state is not None:
            kept = {rid: map_tensors(lambda t, lane=lanes[rid]: t[lane], new_state) for rid in running}
        self.context.commit()
        for rid in running:
            req = self._requests[rid]
            req.written += parsed[rid].span
            if self.initial_state is not None:
                req.state = kept[rid]
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
        state_leaves = state_spec = None
        if self._new_state is not None:
            state_leaves, state_spec = flatten(self._new_state(None), "initial_state()")
        for B in self.batch_sizes:
            for T in self.token_sizes:
                step = BoundedKVStep(tuple(Segment(None, 0) for _ in range(B)), {}, tokens=T)
                # A step of padding alone: it reads and writes nothing a request holds, and commits nothing.
                with self.context.stepping(step) as plan:
                    inputs = unflatten(spec, pad_by_lane({}, template, B, T, per_request))
                    with torch.no_grad():
                        if state_leaves is None:
                            run(plan, inputs)
                        else:
                            run(plan, inputs, unflatten(state_spec, pad_by_lane({}, state_leaves, B, None)))
                    # The graph attends what every later step of this shape will: refuse it here, on a
                    # padding step that changed nothing a request holds.
                    self.context.check_attendance(f"StreamSession warm-up of the model step (B={B}, T={T})")
                self._warm.add((step_key(fn), B, T))
        return time.perf_counter() - t0
