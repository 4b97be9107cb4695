"""`StepTransaction`: one model step over a cache, whole or not at all.

Every front door runs a step the same way, through one of these:
`StreamSession.step`, `flexkv.model.step_context.StepContext` (`begin`/`commit`,
`abort`, or `with context.stepping(step)`) and the transformers
integration's `FlexKVCache` (`prepare`/`commit`/`rollback`). A step is

    txn = StepTransaction(cache)
    plan = txn.begin(step)     # admit (checks every declaration, atomic), then plan on the host
    ...                        # the caller runs the model: attend(layer, q, k, v, plan) per layer
    txn.commit()               # the commit checks, then cache.commit(step) for every planned step

or the same inside `with StepTransaction(cache) as txn:`, which commits when
the block ends and aborts when it raises.

One step may span several caches (a model with two attention stacks, each
with a cache of its own: `flexkv.model.multi_context.MultiStepContext`):
`admit`, `plan` and `begin` take `cache=` (default: the one the transaction
was made with), the transaction records which cache each admission and
plan belongs to, `commit` runs every check before it commits any cache, and
`abort` takes back the admissions of every cache. Either all of the caches
take the step or none does.

What a failed step undoes (docs/contract.md section 5): on `abort()` (any
exception, `KeyboardInterrupt` included, before `commit` finished) every
undo the step recorded runs once, last first:

* each `admit` is taken back with `cache.undo_admit`: the requests it gave a
  slot leave (the slots return to the pool; a private source given before
  the step stays), the streams it started are unbound again;
* a front door's own bookkeeping (a session's lanes and queue, a
  transformers cache's selection and columns) is taken back by the undos it
  registered with `add_undo`.

Nothing is committed, so every written count stays. What the step's
`attend` calls wrote into the slots is not erased: no position says it was
written, so nothing reads it (the contract's "a slot is only read where a
position says it was written").

`add_commit_check(check)` is the hook for a check of the whole step that must
pass before anything is committed: `commit` runs every `check(txn)` first,
and if one raises, the step is aborted and the error raised.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

from ...step import BoundedKVStep
from .slots import Admission

__all__ = ["StepTransaction"]

OPEN, COMMITTED, ABORTED = "open", "committed", "aborted"


class StepTransaction:
    """One step over `cache` (any `flexkv.cache.protocol.StreamCache`): admit, plan, commit or abort.

    Calls given another `cache=` add that cache to the step (`caches` lists
    them, first the one given here). `status` is ``"open"``, then ``"committed"`` or ``"aborted"``; a step
    that is no longer open takes no more calls, and `abort` of one is a
    no-op, so a door's `except` may call it whatever happened before.
    """

    def __init__(self, cache):
        self.cache = cache
        #: Every cache the step spans, in the order they joined it (`cache` first).
        self.caches: List[Any] = [cache]
        self.status = OPEN
        #: The steps planned in this transaction, committed in this order.
        self.steps: List[BoundedKVStep] = []
        self._planned: List[Tuple[Any, BoundedKVStep]] = []  # (cache, step), in plan order
        self._undo: List[Callable[[], None]] = []
        self._checks: List[Callable[["StepTransaction"], None]] = []

    @property
    def is_open(self) -> bool:
        return self.status == OPEN

    def _check_open(self, what: str) -> None:
        if self.status != OPEN:
            raise ValueError(f"StepTransaction.{what}: this step is already {self.status}; begin a new one")

    # ----------------------------------------------------------------- the step

    def _join(self, cache) -> Any:
        """The cache a call is for: the transaction's own (None), or another one, which joins the step."""
        if cache is None:
            return self.cache
        if not any(c is cache for c in self.caches):
            self.caches.append(cache)
        return cache

    def admit(self, step: BoundedKVStep, cache: Optional[Any] = None) -> Admission:
        """`cache.admit(step)` (atomic; default: the transaction's cache), recorded so that `abort` takes
        it back."""
        self._check_open("admit")
        cache = self._join(cache)
        admission = cache.admit(step)
        if admission.new or admission.started:
            self.add_undo(lambda: cache.undo_admit(admission))
        return admission

    def plan(self, step: BoundedKVStep, cache: Optional[Any] = None, *, eager_only: bool = False) -> Any:
        """`cache.plan(step)`; the step is committed with the others by `commit`. `eager_only=True`: the
        step's layers run eagerly, so a cache that has `plan_eager` (flexkv's own, outside the protocol)
        plans it with that, a plan only eager calls read."""
        self._check_open("plan")
        cache = self._join(cache)
        eager = getattr(cache, "plan_eager", None) if eager_only else None
        plan = eager(step) if eager is not None else cache.plan(step)
        self.steps.append(step)
        self._planned.append((cache, step))
        return plan

    def begin(self, step: BoundedKVStep, cache: Optional[Any] = None, *, eager_only: bool = False) -> Any:
        """Admit and plan `step` (in `cache`, default the transaction's; `eager_only` as in `plan`); returns
        its plan. If planning fails, the whole transaction is aborted (this admit and every earlier one)."""
        self.admit(step, cache)
        try:
            return self.plan(step, cache, eager_only=eager_only)
        except BaseException:
            self.abort()
            raise

    def add_undo(self, undo: Callable[[], None]) -> None:
        """Run `undo()` if the step is aborted (after the undos registered later: last first)."""
        self._check_open("add_undo")
        self._undo.append(undo)

    # ------------------------------------------------------------- the outcome

    def add_commit_check(self, check: Callable[["StepTransaction"], None]) -> None:
        """Run `check(self)` in `commit`, before anything is committed (the step's own checks)."""
        self._check_open("add_commit_check")
        self._checks.append(check)

    def run_commit_checks(self) -> None:
        """The hook point of a whole-step check: every `add_commit_check` check, in order."""
        for check in self._checks:
            check(self)

    def commit(self) -> None:
        """Run the commit checks (of every cache), then commit every planned step in order, each to
        its cache. A check that raises aborts the step (nothing committed in any cache) and the
        error is raised."""
        self._check_open("commit")
        try:
            self.run_commit_checks()
        except BaseException:
            self.abort()
            raise
        for cache, step in self._planned:
            cache.commit(step)
        self.status = COMMITTED
        self._undo = []

    def abort(self) -> bool:
        """Undo everything the step recorded, last first; returns False when it was not open."""
        if self.status != OPEN:
            return False
        self.status = ABORTED
        undo, self._undo = self._undo, []
        error = None
        for fn in reversed(undo):  # every undo runs, even after one fails (or is interrupted)
            try:
                fn()
            except BaseException as exc:
                error = exc if error is None else error
        if error is not None:
            raise error
        return True

    def __enter__(self) -> "StepTransaction":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self.abort()
        elif self.is_open:
            self.commit()
        return False

    def __repr__(self):
        more = f", {len(self.caches)} caches" if len(self.caches) > 1 else ""
        return f"StepTransaction({self.status}, {len(self.steps)} planned step(s){more})"
