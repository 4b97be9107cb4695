"""`MultiStepContext`: one model step over several caches, whole or not at all.

Some models keep more than one cache: a streaming speech encoder whose two
attention stacks run at different frame rates (25 and 50 frames per chunk),
each stack with its own layers, heads, retention and step length. Each
cache has its own `StepContext`; a `MultiStepContext` names them and steps
them together in one `flexkv.cache.transaction.StepTransaction`:

    multi = MultiStepContext({"slow": cache_25, "fast": cache_50})
    model = Encoder(slow_attention=lambda i: attention(multi["slow"], i),
                    fast_attention=lambda i: attention(multi["fast"], i))

    plans = multi.begin({"slow": step_25, "fast": step_50})  # admit + plan, every cache or none
    y = model(x)                                              # each stack attends through its own cache
    multi.commit()                                            # every cache's checks, then every commit

or `with multi.stepping(steps) as plans:`. In a compiled step, call
`multi.bind(plans)` inside the compiled function (the plans are its input).
`multi[name]` is that cache's `StepContext`: what `flexkv.model.wrap.attention`
and `flexkv.swap_attention` take, so each stack is routed to its cache by
the model's own code, and what a model function called as `fn(attn, x)`
reaches with `attn[name](layer, q, k, v)`.

What it guarantees:

- `begin` takes one `BoundedKVStep` per cache, every cache named (a cache
  no request feeds gets a step of padding segments). It admits and plans
  them in order; if any cache refuses (a declaration, a full slot pool, a
  step its layers' checks refuse, a `KeyboardInterrupt`), every cache's
  admission is taken back and the error says which cache refused.
- `commit` first runs every cache's commit checks (each `StepContext`
  refuses a step that did not attend each of its declared layers exactly
  once, naming the cache), then commits every cache. A failed check
  commits nothing in any cache.
- `abort` (or an exception inside `stepping`) takes back the whole step in
  every cache: new requests leave every cache, no written count moves.

The caches stay independent otherwise: a request's slot, written count and
retention are per cache, and each cache's `StepContext` can still step it
alone between multi-cache steps.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Hashable, Iterator, Mapping, Optional

from ..cache.slots import SlotsExhausted
from ..cache.transaction import StepTransaction
from ..step import BoundedKVStep
from .wrap import StepContext

__all__ = ["MultiStepContext", "named_error"]


def named_error(exc: BaseException, name: Hashable, where: str) -> BaseException:
    """`exc` again, of its own type, with `where` and the cache `name` in front of its message (the
    original when its type cannot be rebuilt from one message, or it is not an `Exception`)."""
    if not isinstance(exc, Exception):
        return exc
    try:
        named = type(exc)(f"{where}: cache {name!r}: {exc}")
    except Exception:
        return exc
    named.__cause__ = exc
    return named


class MultiStepContext(Mapping):
    """Named caches stepped as one (module docstring): `multi[name]` is each cache's `StepContext`.

    Args:
        caches: a non-empty mapping of name -> a flexkv cache
            (`flexkv.cache.protocol.StreamCache`) or a `StepContext` over one;
            every cache at most once.
    """

    def __init__(self, caches: Mapping[Hashable, Any]):
        if not isinstance(caches, Mapping) or not caches:
            raise ValueError("MultiStepContext needs a non-empty mapping of name -> cache (or StepContext), "
                             f"got {caches!r}")
        contexts: Dict[Hashable, StepContext] = {}
        for name, c in caches.items():
            ctx = c if isinstance(c, StepContext) else StepContext(c)
            same = next((n for n, o in contexts.items() if o.cache is ctx.cache), None)
            if same is not None:
                raise ValueError(
                    f"MultiStepContext: caches {same!r} and {name!r} are the same cache object; each name needs a "
                    f"cache of its own (two names over one cache would write every step to it twice)"
                )
            contexts[name] = ctx
        self.contexts = contexts
        #: The step begun last, over every cache (None before the first).
        self.transaction: Optional[StepTransaction] = None
        #: name -> the plan of the bound step.
        self.plans: Optional[Dict[Hashable, Any]] = None

    # ------------------------------------------------------------- mapping

    def __getitem__(self, name) -> StepContext:
        try:
            return self.contexts[name]
        except KeyError:
            raise KeyError(f"no cache named {name!r}; this step's caches are {list(self.contexts)}") from None

    def __iter__(self) -> Iterator:
        return iter(self.contexts)

    def __len__(self) -> int:
        return len(self.contexts)

    @property
    def caches(self) -> Dict[Hashable, Any]:
        """name -> cache."""
        return {name: ctx.cache for name, ctx in self.contexts.items()}

    # ------------------------------------------------------------- the step

    def check_steps(self, steps: Mapping[Hashable, BoundedKVStep], where: str = "MultiStepContext.begin") -> None:
        """Raise unless `steps` gives exactly one `BoundedKVStep` per cache."""
        if not isinstance(steps, Mapping):
            raise ValueError(f"{where}: steps must be a mapping of cache name -> BoundedKVStep, got {steps!r}")
        unknown = [n for n in steps if n not in self.contexts]
        missing = [n for n in self.contexts if n not in steps]
        if unknown or missing:
            raise ValueError(
                f"{where}: give one step per cache, named {list(self.contexts)}; "
                + (f"no cache is named {unknown}" if unknown else "")
                + ("; " if unknown and missing else "")
                + (f"no step for {missing} (a cache that no request feeds this step takes a step of padding "
                   f"segments: its layers are still attended, once each)" if missing else "")
            )
        for name, step in steps.items():
            if not isinstance(step, BoundedKVStep):
                raise ValueError(f"{where}: the step of cache {name!r} must be a BoundedKVStep, got {step!r}")

    def begin(self, steps: Mapping[Hashable, BoundedKVStep],
              transaction: Optional[StepTransaction] = None) -> Dict[Hashable, Any]:
        """Admit and plan each cache's step, in one transaction (`transaction`, or a new one); returns
        name -> plan. If any cache refuses, no cache keeps anything of the step and the error names
        the cache. Refused while the step begun last is still open."""
        if self.transaction is not None and self.transaction.is_open:
            raise ValueError("MultiStepContext.begin: the step begun last is still open; commit() it after its "
                             "forward, or abort() it if the forward failed")
        self.check_steps(steps)
        first = next(iter(self.contexts.values()))
        txn = StepTransaction(first.cache) if transaction is None else transaction
        plans: Dict[Hashable, Any] = {}
        name = None
        try:
            for name, ctx in self.contexts.items():
                plans[name] = ctx.begin(steps[name], txn)
        except SlotsExhausted as exc:
            txn.abort()
            raise SlotsExhausted(
                f"MultiStepContext.begin: cache {name!r} has no free slot for the step's new requests ({exc}); "
                f"the step was admitted in no cache"
            ) from exc
        except BaseException as exc:
            txn.abort()
            raise named_error(exc, name, "MultiStepContext.begin") from None
        self.transaction, self.plans = txn, plans
        return plans

    def bind(self, plans: Mapping[Hashable, Any]) -> None:
        """Make `plans` (name -> plan) the ones each cache's layers read (inside a compiled step)."""
        for name, ctx in self.contexts.items():
            ctx.bind(plans[name])
        self.plans = dict(plans)

    def check_attendance(self, where: str = "MultiStepContext.commit") -> None:
        """Raise `flexkv.model.attendance.AttendanceError` unless every cache's every declared layer was
        attended exactly once this step (the first cache that fails is named)."""
        for name, ctx in self.contexts.items():
            ctx.check_attendance(f"{where} (cache {name!r})")

    def commit(self) -> None:
        """Every cache's commit checks (attendance first, naming the cache), then every cache's commit:
        all or nothing. A check that fails aborts the step in every cache."""
        if self.transaction is None:
            raise ValueError("MultiStepContext.commit: no step was begun; call begin(steps) first")
        if self.transaction.is_open:
            try:
                self.check_attendance()
            except BaseException:
                self.transaction.abort()
                raise
        self.transaction.commit()

    def abort(self) -> bool:
        """Take back the step begun last in every cache; False when no step is open."""
        return self.transaction is not None and self.transaction.abort()

    @contextlib.contextmanager
    def stepping(self, steps: Mapping[Hashable, BoundedKVStep]):
        """`with multi.stepping(steps) as plans:` begins, commits when the block ends, aborts when it raises."""
        plans = self.begin(steps)
        try:
            yield plans
        except BaseException:
            self.abort()
            raise
        self.commit()

    def __repr__(self):
        return f"MultiStepContext({', '.join(f'{n!r}: {type(c.cache).__name__}' for n, c in self.contexts.items())})"
