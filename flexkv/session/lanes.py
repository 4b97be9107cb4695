"""`LaneSession`: the request and step bookkeeping `StreamSession` and `MultiCacheSession` share.

A session gives every request a lane (its batch row in every step) and,
through its cache or caches, a slot. What does not depend on how many
caches there are lives here, once:

1. **Lanes and the queue.** A request takes the lowest free lane when it
   starts, or waits first come first served (`when_full="queue"`), or is
   refused (`"refuse"`). Lanes freed by `finish` go to waiting requests
   whose declaration still holds (`_admit_waiting`); one whose declaration
   broke keeps its place and says why when it is fed (`_recheck_blocked`).
2. **One operation at a time** (`_exclusive`): a re-entrant or concurrent
   call raises and changes nothing.
3. **The step's shape.** Which fed requests run, start or wait
   (`_sort_step`); the batch bucket `B`; one `StepTransaction` around
   admitting the new requests, queueing the deferred ones and running the
   step (`_in_transaction`), so that any failure takes all of it back.
4. **The compiled step.** One `torch.compile`d function per step function
   (`step_key`: a new lambda of the same code and closure is the same
   step), a warning when the same code compiles again with other closure
   values, and a watch for recompiles after warm-up.
5. **Carried model state** (`initial_state`): stacked by lane for the call,
   checked on return, kept per request at commit; a rollback must be given
   the state it goes back to.

A subclass says what a request declares (`decl`: `StreamSession`'s
`(source, source_len)`, `MultiCacheSession`'s per-cache mapping of them;
`_empty_decl` is what a request a step starts declares) and provides `_check_start(request_id, decl, restart=False)`, `_admit(request_id,
decl, transaction)` (a slot in every cache, then `_take_lane`),
`_transaction()`, `_remove_request(request_id)` and
`_free_private_sources(request_id)`.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from ..cache.slots import SlotsExhausted
from ..cache.transaction import StepTransaction
from ..compiling import RecompileWarning, fresh_function, watch_recompiles
from ..config import is_int
from .feeds import flatten, map_tensors, pad_by_lane, unflatten
from .state import check_new_state, state_factory
from .step_functions import closure_difference, step_key

__all__ = ["LaneSession", "Waiting", "WHEN_FULL", "RECOMPILE_ADVICE", "bucket_sizes"]

WHEN_FULL = ("queue", "refuse")

_session_ids = itertools.count()

#: What a recompile after warm-up means and what to do, after the guard that failed.
RECOMPILE_ADVICE = (
    "The session compiles the model step once per (B, T) at warm-up; a later compile means the graph depends "
    "on a Python value that changed between steps, such as an int or flag kept on a module (a position offset "
    "or step counter of a model left in its own streaming or caching mode), a global, or the length of a "
    "Python list. Keep such values out of the step: switch the model's own cache and streaming state off "
    "(flexkv keeps the stream), take positions from the cache (attn.stream_positions()), and pass anything "
    "else that changes per step as a tensor input or buffer. TORCH_LOGS=recompiles logs every recompile."
)


_SESSION_DIR = os.path.dirname(os.path.abspath(__file__))


def _caller_stacklevel() -> int:
    """The `stacklevel` at which a warning raised by the function calling this one names the first
    frame outside `flexkv.session`: the user's call into the session."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == _SESSION_DIR:
        frame, level = frame.f_back, level + 1
    return level


def bucket_sizes(name: str, sizes, default: Tuple[int, ...], hi: int, hi_name: str) -> Tuple[int, ...]:
    """`sizes` (or `default`) as the sorted distinct bucket sizes in `[1, hi]`; a `ValueError` names
    `name` and the bound (`hi_name=hi`) otherwise."""
    if sizes is None:
        return default
    try:
        values = tuple(sizes)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints in [1, {hi_name}={hi}], got {sizes!r}") from None
    if not values or any(not is_int(v) or not 1 <= v <= hi for v in values):
        raise ValueError(f"{name} must be a non-empty sequence of ints in [1, {hi_name}={hi}], got {sizes!r}")
    return tuple(sorted(set(values)))


@dataclass
class Waiting:
    """A request waiting for a lane, with what it declared (`decl`) and why it could not take the last
    lane that freed up (`blocked`: its declaration broke), if so."""

    request_id: Hashable
    decl: Any
    blocked: Optional[str] = None


class LaneSession:
    """Lanes, the waiting queue, the step's transaction and compiled function (module docstring).

    Subclasses set `context` (a step context: `bind`, `begin`, `check_attendance`, `commit`,
    `stepping`) before the first step.
    """

    #: What a request declares when a step starts it (no source anywhere); set by the subclass.
    _empty_decl: Any = None

    def __init__(self, max_slots: int, batch_sizes: Optional[Sequence[int]], when_full: str, compile: bool,
                 initial_state: Optional[Callable[..., Any]], code_prefix: str):
        if when_full not in WHEN_FULL:
            raise ValueError(f"when_full must be one of {WHEN_FULL}, got {when_full!r}")
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be a bool, got {compile!r}")
        if initial_state is not None and not callable(initial_state):
            raise ValueError(f"initial_state must be a callable returning a new request's state, got {initial_state!r}")
        batch = bucket_sizes("batch_sizes", batch_sizes, (max_slots,), max_slots, "max_slots")
        if batch[-1] != max_slots:
            raise ValueError(
                f"batch_sizes={list(batch)} cannot hold every lane: requests take lanes 0..{max_slots - 1} "
                f"(max_slots={max_slots}), so the largest batch size must be {max_slots}; add it, or lower max_slots"
            )
        self.max_slots = max_slots
        self.batch_sizes = batch
        self.when_full = when_full
        self.compile = compile
        self.initial_state = initial_state
        self._new_state = None if initial_state is None else state_factory(initial_state)
        self._code_prefix = f"{code_prefix}{next(_session_ids)}"
        self._requests: Dict[Hashable, Any] = {}  # started requests (the subclass's record, with .lane and .state)
        self._free_lanes: List[int] = list(range(max_slots))
        # Waiting requests by id, first come first served (a dict keeps the order it was filled in).
        self._queue: Dict[Hashable, Waiting] = {}
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
        return tuple(self._queue)

    @property
    def free_lanes(self) -> int:
        return len(self._free_lanes)

    def lane(self, request_id: Hashable) -> int:
        """The lane (batch row) a started request holds."""
        return self._get(request_id).lane

    def state(self, request_id: Hashable):
        """A started request's carried model state (None without `initial_state`)."""
        return self._get(request_id).state

    def _get(self, request_id):
        req = self._requests.get(request_id)
        if req is None:
            where = " (it waits for a lane)" if self._waiting(request_id) is not None else ""
            raise ValueError(f"request {request_id!r} holds no lane{where}; start() it or feed it to step()")
        return req

    def _waiting(self, request_id) -> Optional[Waiting]:
        try:
            return self._queue.get(request_id)
        except TypeError:  # an unhashable id waits nowhere
            return None

    def _enqueue(self, w: Waiting) -> None:
        self._queue[w.request_id] = w

    def _dequeue(self, w: Waiting) -> None:
        del self._queue[w.request_id]

    @contextlib.contextmanager
    def _exclusive(self, what: str):
        """Run one session operation at a time; refuse re-entrant and concurrent calls, changing nothing."""
        me = threading.get_ident()
        kind = type(self).__name__
        if not self._guard.acquire(blocking=False):
            running, owner = self._running or ("an operation", None)
            if owner == me:
                raise RuntimeError(
                    f"{kind}.{what}() was called while {running}() is running in the same thread (from inside the "
                    f"model function, or a callback of it); a session runs one operation at a time: call it after "
                    f"{running}() returns. Nothing changed"
                )
            raise RuntimeError(
                f"{kind}.{what}() was called from another thread while {running}() runs; a session is not "
                f"thread-safe: give each thread a session of its own, or serialise the calls with a lock. "
                f"Nothing changed"
            )
        self._running = (what, me)
        try:
            yield
        finally:
            self._running = None
            self._guard.release()

    # --------------------------------------------------------- lifecycle

    def _new_request_state(self, request_id):
        """A new (or reset) request's model state, or None without `initial_state`."""
        return None if self._new_state is None else self._new_state(request_id)

    def _take_lane(self, request_id, record, transaction: Optional[StepTransaction] = None) -> None:
        """Give `request_id` the lowest free lane, keeping `record(lane)` for it; in a step's
        `transaction`, the lane is given back if the step fails."""
        self._requests[request_id] = record(self._free_lanes.pop(0))
        if transaction is not None:
            transaction.add_undo(lambda: self._give_back_lane(request_id))

    def _give_back_lane(self, request_id) -> None:
        """The request leaves its lane (a failed step's undo, a finish)."""
        self._free_lanes.append(self._requests.pop(request_id).lane)
        self._free_lanes.sort()

    def _admit_now(self, request_id, decl) -> None:
        """`_admit` on its own: a transaction that plans nothing, committed when every cache took it."""
        transaction = self._transaction()
        try:
            self._admit(request_id, decl, transaction)
        except BaseException:
            transaction.abort()
            raise
        transaction.commit()

    def _start(self, request_id, decl) -> bool:
        """`start`: a lane now (True), a place in the queue (False), or `SlotsExhausted` when refusing;
        `decl` is checked first, whether the request starts or waits."""
        if request_id in self._requests or self._waiting(request_id) is not None:
            raise ValueError(f"request {request_id!r} is already started; finish() or reset() it")
        self._check_start(request_id, decl)
        if self._free_lanes:
            self._admit_now(request_id, decl)
            return True
        if self.when_full == "refuse":
            raise SlotsExhausted(
                f"all {self.max_slots} lanes are held, so request {request_id!r} cannot start; finish() a request "
                f"first, raise max_slots, or use when_full='queue'"
            )
        self._enqueue(Waiting(request_id, decl))
        return False

    def _finish(self, request_id) -> None:
        """`finish`: out of the queue, or out of every cache and its lane (then handed to waiting
        requests); a private source is freed also for a request given one and never started."""
        w = self._waiting(request_id)
        if w is not None:
            self._free_private_sources(request_id)
            self._dequeue(w)
            return
        if request_id not in self._requests and self._free_private_sources(request_id):
            return  # given a private source, never started
        self._get(request_id)
        self._remove_request(request_id)
        self._give_back_lane(request_id)
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        """Give free lanes to waiting requests, first come first served, each checked first."""
        for w in list(self._queue.values()):
            if not self._free_lanes:
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
            self._dequeue(w)

    def _redeclare_waiting(self, w: Waiting, decl) -> None:
        """`reset` of a waiting request: its new declaration, checked, keeps its place in the queue."""
        self._check_start(w.request_id, decl)
        w.decl, w.blocked = decl, None
        self._admit_waiting()

    def _fork_parent(self, request_id, new_id):
        """`fork`'s checks of the session's own: the parent's record; a free lane for `new_id` now."""
        parent = self._get(request_id)
        if new_id in self._requests or self._waiting(new_id) is not None:
            raise ValueError(f"fork: request {new_id!r} is already started; finish() it or pick another id")
        if not self._free_lanes:
            raise SlotsExhausted(
                f"fork: all {self.max_slots} lanes are held, so {new_id!r} cannot start as a copy of "
                f"{request_id!r} (a fork copies the stream now and cannot wait); finish() a request first or "
                f"raise max_slots"
            )
        return parent

    def _forked_state(self, parent):
        return None if parent.state is None else map_tensors(lambda t: t.clone(), parent.state)

    def _check_rollback_state(self, request_id, req, takes_back: bool, state) -> None:
        """A rollback's `state`: required (and shaped like the request's) when the session carries model
        state and tokens are taken back; refused without `initial_state`."""
        if state is not None and self._new_state is None:
            raise ValueError("rollback: state= is for a session with initial_state; this one carries none")
        if state is None and self._new_state is not None and takes_back:
            raise ValueError(
                f"rollback: request {request_id!r} carries a model state (initial_state), which the session "
                f"cannot take back by itself; pass state=... with its state from before those tokens"
            )
        if state is not None:
            leaves, spec = flatten(state, "rollback's state")
            have, have_spec = flatten(req.state, f"the state of request {request_id!r}")
            if spec != have_spec or [(t.shape, t.dtype) for t in leaves] != [(t.shape, t.dtype) for t in have]:
                raise ValueError(
                    f"rollback: state must be shaped like request {request_id!r}'s state "
                    f"({[tuple(t.shape) for t in have]}), got {[tuple(t.shape) for t in leaves]}"
                )

    # -------------------------------------------------------------- steps

    def _recheck_blocked(self, fed) -> None:
        """A fed request waiting with a broken declaration: checked again (the reason may be gone), and
        refused with that reason if not."""
        for rid in fed:
            w = self._waiting(rid)
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

    def _sort_step(self, fed, check_new: Callable[[Hashable], None]):
        """Who of the `fed` requests runs: `(starting, deferred, running, waiting)`. New requests (never
        seen) are checked with `check_new`, then start while lanes are free, in feed order; the rest
        wait (or, refusing, the step raises `SlotsExhausted`)."""
        queued = self._queue  # read only here: nothing is queued until the step's transaction
        new = [rid for rid in fed if rid not in self._requests and rid not in queued]
        for rid in new:
            check_new(rid)
        free = len(self._free_lanes)
        if len(new) > free and self.when_full == "refuse":
            raise SlotsExhausted(
                f"the step starts {len(new)} new request(s) but only {free} of {self.max_slots} lanes are free; "
                f"finish() requests first, raise max_slots, or use when_full='queue'"
            )
        starting, deferred = new[:free], new[free:]
        later = set(deferred)
        running = [rid for rid in fed if rid not in queued and rid not in later]
        waiting = tuple(rid for rid in fed if rid in queued or rid in later)
        return starting, deferred, running, waiting

    def _lanes(self, running, starting) -> Tuple[Dict[Hashable, int], int]:
        """Each running request's lane (new ones take the lowest free lanes, in feed order) and the
        batch bucket `B` that holds them."""
        lanes = {rid: self._requests[rid].lane for rid in running if rid in self._requests}
        for rid, lane in zip(starting, self._free_lanes):
            lanes[rid] = lane
        return lanes, next(s for s in self.batch_sizes if s > max(lanes.values()))

    def _in_transaction(self, starting, deferred, run: Callable[[StepTransaction], Any]):
        """From here on the session changes, in one step transaction: start the new requests, queue the
        deferred ones, then `run(transaction)` the step. A failure anywhere takes all of it back."""
        transaction = self._transaction()
        try:
            for rid in starting:
                self._admit(rid, self._empty_decl, transaction)
            for rid in deferred:
                w = Waiting(rid, self._empty_decl)
                self._enqueue(w)
                transaction.add_undo(lambda w=w: self._dequeue(w))
            return run(transaction)
        except BaseException:
            transaction.abort()  # a failed step leaves no request it started
            raise

    def _runner(self, fn: Callable) -> Callable:
        """The (compiled) step of `fn`: `step(plans, inputs[, state])` binds the plans to the context
        inside the graph (an input, not a guard) and calls `fn(context, inputs[, state])`."""
        key = step_key(fn)
        run = self._runners.get(key)
        if run is not None:
            return run
        context = self.context
        if self.initial_state is None:
            def session_step(plans, inputs):
                context.bind(plans)
                return fn(context, inputs)
        else:
            def session_step(plans, inputs, state):
                context.bind(plans)
                return fn(context, inputs, state)
        if self.compile:
            # A code object of its own: compiled graphs are cached per code object, and another
            # session's (or another fn's) entries must not be walked or evicted by this one.
            fresh = fresh_function(session_step, f"{self._code_prefix}_{len(self._runners)}")
            self._step_codes[key] = fresh.__code__
            session_step = torch.compile(fresh, fullgraph=True, dynamic=False)
            self._warn_if_compiled_before(fn, key)
        self._runners[key] = session_step
        return session_step

    def _warn_if_compiled_before(self, fn: Callable, key) -> None:
        """Say so when a step function of the same code, with other closure values, compiles again (a
        lambda capturing a loop variable, made anew every step)."""
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is None or self._compiled_code.setdefault(code, key) == key:
            return
        differ = closure_difference(fn, key, self._compiled_code[code])
        warnings.warn(
            f"{type(self).__name__}.step: fn {getattr(code, 'co_name', fn)!r} ({code.co_filename}:"
            f"{code.co_firstlineno}) is a new function with the code of one compiled before but other values"
            f"{f' ({differ})' if differ else ''}, so the model step compiles again (seconds per compile, every "
            f"time such a function is made). Define the step function once, outside the step loop, and pass "
            f"what changes per step as an input (a tensor in the feed) or a buffer",
            RecompileWarning, stacklevel=_caller_stacklevel(),
        )

    def _call(self, fn, plans, inputs, running, lanes, B: int, what: str):
        """Run the step of `fn` on `plans` and padded `inputs`: `(outputs, new_state or None)`, the
        requests' states stacked by lane (zeros on padded lanes) with `initial_state`. Compiled, a
        recompile after warm-up warns with the guard that failed (`what` names the step)."""
        run = self._runner(fn)
        # The warning is raised in the watch's generator, two frames below this one (contextlib's exit).
        watch = (watch_recompiles(self._step_codes[step_key(fn)], f"{type(self).__name__}.step: the compiled model "
                                  f"step ({what})", RECOMPILE_ADVICE, stacklevel=_caller_stacklevel() + 2)
                 if self.compile else contextlib.nullcontext())
        with torch.no_grad(), watch:
            if self.initial_state is None:
                return run(plans, inputs), None
            states = {lanes[r]: flatten(self._requests[r].state, f"the state of request {r!r}") for r in running}
            s_leaves, s_spec = states[lanes[running[0]]]
            stacked = pad_by_lane({lane: lv for lane, (lv, _) in states.items()}, s_leaves, B, None)
            return check_new_state(run(plans, inputs, unflatten(s_spec, stacked)), stacked, s_spec)

    def _commit(self, new_state, running, lanes, what: str) -> None:
        """Commit the step: the context's commit (its one attendance check refuses a step that left a
        declared layer unattended; then the caches advance every stream), then the new state of every
        running request (plain assignments only after the commit)."""
        kept = {}
        if new_state is not None:
            kept = {rid: map_tensors(lambda t, lane=lanes[rid]: t[lane], new_state) for rid in running}
        self.context.commit(f"{type(self).__name__}.step ({what})")
        for rid in running:
            if new_state is not None:
                self._requests[rid].state = kept[rid]

    def _padding_state(self):
        """The `(leaves, spec)` of a new request's state for warm-up steps, or None without `initial_state`."""
        return None if self._new_state is None else flatten(self._new_state(None), "initial_state()")

    def _padding_call(self, run, plans, inputs, B: int, padding_state) -> None:
        """One warm-up call of the step on padding alone (`padding_state` from `_padding_state`)."""
        with torch.no_grad():
            if padding_state is None:
                run(plans, inputs)
            else:
                leaves, spec = padding_state
                run(plans, inputs, unflatten(spec, pad_by_lane({}, leaves, B, None)))
