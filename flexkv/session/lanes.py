"""What a session keeps beside its step: its caches, lanes and waiting queue, and one operation at a time.

A session (`flexkv.session.stream_session.StreamSession`) runs over one
cache or a mapping of named caches; `session_caches` builds and checks them
once (the one cache of a one-cache session is named None). It gives every
request a lane (its batch row in every step) from its start until it
finishes: the lowest free lane. When every lane is held, a new request
waits first come first served (`when_full="queue"`) or is refused
(`"refuse"`). `Lanes` is that bookkeeping and nothing else: it knows no
cache, runs no model and calls nothing back; the session asks it and tells
it what happened.

- `records`: request id -> what the session keeps of a started request
  (its `lane`, and its carried model `state`);
- `free`: the free lanes, lowest first;
- `queue`: the waiting requests (`Waiting`: the id, what it declared, and
  why it could not take the last lane that freed up, if its declaration
  broke), first in line first.

A step's requests are sorted here (`sort`: who runs, who starts, who
waits) and placed (`place`: each running request's lane and the batch
bucket `B` that holds them). Beside it: what a request declares when it
starts (`declarations`: a `(source, source_len)` per cache), the form of a
source call (`source_call`: over named caches the cache's name comes
first), and `OneAtATime`, the guard that runs one session operation at a
time.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple

from ..cache.host.slots import SlotsExhausted
from ..cache.host.transaction import StepTransaction
from ..cache.manager import BoundedKVManager
from ..cache.protocol import check_cache
from ..config import BoundedKVConfig, is_int

__all__ = ["Lanes", "Waiting", "WHEN_FULL", "bucket_sizes", "session_caches", "declarations", "source_call",
           "OneAtATime"]

#: A source call's arguments after the cache's name (which a session over named caches takes first).
_SOURCE_ARGS = {"add_source": "keys, values", "remove_source": "index",
                "add_private_source": "request_id, keys, values", "remove_private_source": "request_id"}

WHEN_FULL = ("queue", "refuse")


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


def session_caches(kind: str, cache, device, groups, block_size, token_sizes, compile: bool):
    """A `kind` session's caches and token buckets from its arguments: `({name: cache}, {name: token
    sizes})`, a one-cache session's cache named None. Builds a cache from each `BoundedKVConfig` (with
    `groups` and `block_size`) and checks every cache: a flexkv cache holding no request, traceable with
    `compile=True`, every cache with the same `max_slots`."""
    one = not isinstance(cache, Mapping)
    if one:
        if isinstance(cache, BoundedKVConfig):
            cache = BoundedKVManager(cache, device, groups=groups, block_size=block_size)
        elif block_size is not None or groups is not None:
            raise ValueError("block_size and groups are for a cache the session builds from a BoundedKVConfig; "
                             f"this {type(cache).__name__} already has its layout")
        caches = {None: check_cache(cache, kind)}
    else:
        if not cache:
            raise ValueError(f"{kind} needs a non-empty mapping of name -> BoundedKVConfig or cache, got {cache!r}")
        if groups is not None:
            raise ValueError("groups is for one cache built from a BoundedKVConfig; give a named cache its layer "
                             "groups as a BoundedKVManager(config, groups=...)")
        caches = {name: check_cache(BoundedKVManager(c, device, block_size=block_size)
                                    if isinstance(c, BoundedKVConfig) else c, f"{kind} (cache {name!r})")
                  for name, c in cache.items()}
        if token_sizes is not None and not isinstance(token_sizes, Mapping):
            raise ValueError(f"token_sizes must be a mapping of cache name -> token sizes, got {token_sizes!r}")
        unknown = [n for n in (token_sizes or {}) if n not in caches]
        if unknown:
            raise ValueError(f"token_sizes names {unknown}, which are not caches of this session ({list(caches)})")
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be a bool, got {compile!r}")
    sizes = {}
    for name, c in caches.items():
        which = f"this {type(c).__name__}" if one else f"cache {name!r}"
        if c.requests:
            raise ValueError(
                f"{kind} needs a cache that holds no request (the session gives out its lanes and slots), but "
                f"{which} holds {list(c.requests)}; remove_request() them first or give the session a cache of "
                f"its own"
            )
        if compile and not c.compilable:
            raise ValueError(f"compile=True needs a cache whose attention traces: {which} ({type(c).__name__}) "
                             f"attends on the host (float64) and is not traceable; pass compile=False")
        m = c.config.max_step_tokens
        sizes[name] = bucket_sizes("token_sizes" if one else f"token_sizes[{name!r}]",
                                   token_sizes if one else (token_sizes or {}).get(name), tuple(sorted({1, m})), m,
                                   "max_step_tokens" if one else f"cache {name!r}'s max_step_tokens")
    slots = {name: c.config.max_slots for name, c in caches.items()}
    if len(set(slots.values())) != 1:
        raise ValueError(
            f"every cache of a {kind} needs the same max_slots (a request holds one lane and one slot in each), "
            f"got {slots}; give them all max_slots={max(slots.values())}"
        )
    return caches, sizes


def source_call(kind: str, one: bool, caches, what: str, args: tuple):
    """A `kind` session's source call's `(cache name, cache, arguments)` (`what`: `add_source`, ...): over
    named `caches` (not `one`) the cache's name comes first, and must be one of them."""
    n = _SOURCE_ARGS[what].count(",") + 1 + (not one)
    if len(args) != n:
        form = _SOURCE_ARGS[what] if one else f"cache_name, {_SOURCE_ARGS[what]}"
        named = "" if one else f" (the caches are {list(caches)})"
        raise TypeError(f"{kind}.{what}({form}) takes {n} arguments{named}, got {len(args)}")
    if one:
        return None, caches[None], args
    name = args[0]
    try:
        known = name in caches
    except TypeError:  # unhashable
        known = False
    if not known:
        raise ValueError(f"{kind}.{what}: no cache {name!r}; this session's caches are {list(caches)}")
    return name, caches[name], args[1:]


def declarations(kind: str, what: str, one: bool, base, source, source_len,
                 sources) -> Dict[Hashable, Tuple[int, int]]:
    """Every cache's `(source, source_len)` after a `kind` session's `start` or `reset` (`what`): `base`
    (name -> pair), changed by what the call gives (`source` / `source_len` for `one` cache, named
    None; `sources={name: (source, source_len)}` over named caches; None keeps a value). Checks the
    form only; the caches check the values (`check_start`)."""
    decls, names = dict(base), list(base)
    if one:
        if sources is not None:
            raise ValueError(f"{what}: sources= is for a session over named caches; this one has one cache: "
                             f"give source= and source_len=")
        was = decls[None]
        decls[None] = (was[0] if source is None else source, was[1] if source_len is None else source_len)
        return decls
    if source not in (None, 0) or source_len not in (None, 0):
        raise ValueError(f"{kind}.{what}: this session's caches are named {names}; declare a source per cache, "
                         f"sources={{name: (source, source_len)}}")
    if sources is None:
        return decls
    if not isinstance(sources, Mapping):
        raise ValueError(f"{kind}.{what}: sources must map a cache name to (source, source_len), "
                         f"e.g. sources={{{names[0]!r}: (0, 4)}}, got {sources!r}")
    for name, decl in sources.items():
        if name not in decls:
            raise ValueError(f"{kind}.{what}: no cache {name!r}; this session's caches are {names}")
        if not isinstance(decl, (tuple, list)) or len(decl) != 2:
            raise ValueError(
                f"{kind}.{what}: sources[{name!r}] must be a (source, source_len) pair (source: an index "
                f"add_source() returned, or -1 for the request's private source), got {decl!r}"
            )
        decls[name] = (decl[0], decl[1])
    return decls


class OneAtATime:
    """`with guard(what):` runs one operation of a `kind` session at a time: a re-entrant call (from inside
    the model function) or a concurrent one (another thread) raises `RuntimeError` and changes nothing."""

    def __init__(self, kind: str):
        self.kind = kind
        self._lock = threading.Lock()
        self._running: Optional[Tuple[str, int]] = None  # (operation, thread id) while one runs

    @contextlib.contextmanager
    def __call__(self, what: str):
        me = threading.get_ident()
        if not self._lock.acquire(blocking=False):
            running, owner = self._running or ("an operation", None)
            if owner == me:
                raise RuntimeError(
                    f"{self.kind}.{what}() was called while {running}() is running in the same thread (from inside "
                    f"the model function, or a callback of it); a session runs one operation at a time: call it "
                    f"after {running}() returns. Nothing changed"
                )
            raise RuntimeError(
                f"{self.kind}.{what}() was called from another thread while {running}() runs; a session is not "
                f"thread-safe: give each thread a session of its own, or serialise the calls with a lock. "
                f"Nothing changed"
            )
        self._running = (what, me)
        try:
            yield
        finally:
            self._running = None
            self._lock.release()


class Lanes:
    """`max_slots` lanes, the waiting queue, and the batch buckets a step is padded to (module docstring).

    `batch_sizes`: the batch sizes `B` a step is padded to (default `(max_slots,)`; the largest must
    be `max_slots`, so every lane fits a batch). `when_full`: ``"queue"`` or ``"refuse"``.
    """

    def __init__(self, max_slots: int, batch_sizes: Optional[Sequence[int]], when_full: str):
        if when_full not in WHEN_FULL:
            raise ValueError(f"when_full must be one of {WHEN_FULL}, got {when_full!r}")
        batch = bucket_sizes("batch_sizes", batch_sizes, (max_slots,), max_slots, "max_slots")
        if batch[-1] != max_slots:
            raise ValueError(
                f"batch_sizes={list(batch)} cannot hold every lane: requests take lanes 0..{max_slots - 1} "
                f"(max_slots={max_slots}), so the largest batch size must be {max_slots}; add it, or lower max_slots"
            )
        self.max_slots = max_slots
        self.batch_sizes = batch
        self.when_full = when_full
        self.records: Dict[Hashable, Any] = {}  # started requests: id -> record with .lane and .state
        self.free: List[int] = list(range(max_slots))
        self.queue: Dict[Hashable, Waiting] = {}  # by id, first come first served (a dict keeps its order)

    # ------------------------------------------------------------- views

    def get(self, request_id: Hashable):
        """The record of a started request, or a `ValueError` saying it holds no lane (and why)."""
        req = self.records.get(request_id)
        if req is None:
            where = " (it waits for a lane)" if self.waiting(request_id) is not None else ""
            raise ValueError(f"request {request_id!r} holds no lane{where}; start() it or feed it to step()")
        return req

    def waiting(self, request_id) -> Optional[Waiting]:
        """The request's place in the queue, or None."""
        try:
            return self.queue.get(request_id)
        except TypeError:  # an unhashable id waits nowhere
            return None

    def known(self, request_id) -> bool:
        """Whether the request holds a lane or waits for one."""
        return request_id in self.records or self.waiting(request_id) is not None

    # --------------------------------------------------------- changes

    def enqueue(self, w: Waiting, transaction: Optional[StepTransaction] = None) -> None:
        """Put `w` last in line; in a step's `transaction`, taken out again if the step fails."""
        self.queue[w.request_id] = w
        if transaction is not None:
            transaction.add_undo(lambda: self.dequeue(w))

    def dequeue(self, w: Waiting) -> None:
        del self.queue[w.request_id]

    def take(self, request_id, record: Callable[[int], Any], transaction: Optional[StepTransaction] = None) -> None:
        """Give `request_id` the lowest free lane, keeping `record(lane)` for it; in a step's
        `transaction`, the lane is given back if the step fails."""
        self.records[request_id] = record(self.free.pop(0))
        if transaction is not None:
            transaction.add_undo(lambda: self.give_back(request_id))

    def give_back(self, request_id) -> None:
        """The request leaves its lane (a failed step's undo, a finish)."""
        self.free.append(self.records.pop(request_id).lane)
        self.free.sort()

    def refuse_full(self, request_id) -> None:
        """`start` with every lane held and `when_full="refuse"`: `SlotsExhausted`."""
        raise SlotsExhausted(
            f"all {self.max_slots} lanes are held, so request {request_id!r} cannot start; finish() a request "
            f"first, raise max_slots, or use when_full='queue'"
        )

    def check_fork(self, request_id, new_id):
        """`fork`'s checks of the lanes: the parent's record; a free lane for `new_id` now."""
        parent = self.get(request_id)
        if self.known(new_id):
            raise ValueError(f"fork: request {new_id!r} is already started; finish() it or pick another id")
        if not self.free:
            raise SlotsExhausted(
                f"fork: all {self.max_slots} lanes are held, so {new_id!r} cannot start as a copy of "
                f"{request_id!r} (a fork copies the stream now and cannot wait); finish() a request first or "
                f"raise max_slots"
            )
        return parent

    # -------------------------------------------------------------- steps

    def new(self, fed) -> List[Hashable]:
        """The `fed` requests never seen (neither holding a lane nor waiting), in feed order."""
        return [rid for rid in fed if rid not in self.records and rid not in self.queue]

    def sort(self, fed, new: List[Hashable]):
        """Who of the `fed` requests runs: `(starting, deferred, running, waiting)`. The `new` ones start
        while lanes are free, in feed order; the rest wait (or, refusing, the step raises
        `SlotsExhausted`). Changes nothing: the session queues the deferred ones in its step."""
        free = len(self.free)
        if len(new) > free and self.when_full == "refuse":
            raise SlotsExhausted(
                f"the step starts {len(new)} new request(s) but only {free} of {self.max_slots} lanes are free; "
                f"finish() requests first, raise max_slots, or use when_full='queue'"
            )
        starting, deferred = new[:free], new[free:]
        later = set(deferred)
        running = [rid for rid in fed if rid not in self.queue and rid not in later]
        waiting = tuple(rid for rid in fed if rid in self.queue or rid in later)
        return starting, deferred, running, waiting

    def place(self, running, starting) -> Tuple[Dict[Hashable, int], int]:
        """Each running request's lane (new ones take the lowest free lanes, in feed order) and the
        batch bucket `B` that holds them."""
        lanes = {rid: self.records[rid].lane for rid in running if rid in self.records}
        for rid, lane in zip(starting, self.free):
            lanes[rid] = lane
        return lanes, next(s for s in self.batch_sizes if s > max(lanes.values()))
