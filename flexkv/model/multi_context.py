"""`MultiStepContext`: one model step over several caches, whole or not at all.

Some models keep more than one cache: a streaming speech encoder whose two
attention stacks run at different frame rates (25 and 50 frames per chunk),
each stack with its own layers, heads, retention and step length. A
`StepContext` over named caches steps them together in one
`flexkv.cache.host.transaction.StepTransaction`: `StepContext({...})` builds
a `MultiStepContext`, the subclass that holds what differs from one cache
(mappings in and out, errors naming their cache), and `multi[name]` is each
cache's one-cache `StepContext`:

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
- `commit` first runs the step's commit checks (the one attendance check:
  every declared layer of every cache attended exactly once, or the first
  cache that fails is named), then commits every cache. A failed check
  commits nothing in any cache.
- `abort` (or an exception inside `stepping`) takes back the whole step in
  every cache: new requests leave every cache, no written count moves.

The caches stay independent otherwise: a request's slot, written count and
retention are per cache, and each cache's context `multi[name]` can still
step it alone between multi-cache steps.
"""

from __future__ import annotations

from typing import Dict, Hashable, Mapping, Optional

from ..cache.host.slots import SlotsExhausted
from .step_context import StepContext, named_error

__all__ = ["MultiStepContext", "named_error"]


class MultiStepContext(StepContext, named_shape=True):
    """`StepContext` over named caches (module docstring; `StepContext({...})` builds one): `multi[name]` is
    each cache's one-cache `StepContext`. What differs from a one-cache context is here, once: `begin`,
    `bind` and `stepping` take and return mappings of name -> step or plan, an error a cache raises
    names it, and what belongs to one cache (`attend`, `config`, `reset_request`, ...) is refused here
    and served by `multi[name]`.

    Args:
        caches: a non-empty mapping of name -> a flexkv cache
            (`flexkv.cache.protocol.StreamCache`) or a one-cache `StepContext`
            over one; every cache at most once.
    """

    def __init__(self, caches: Mapping, *, layers=None):
        kind = type(self).__name__
        if not isinstance(caches, Mapping):
            raise ValueError(f"{kind} needs a non-empty mapping of name -> cache (or one-cache StepContext), got "
                             f"{caches!r}; a context over one cache is StepContext(cache)")
        if layers is not None:
            raise ValueError(f"{kind}: layers= maps a model's layers onto one cache's; over named caches give each "
                             f"cache's own StepContext(cache, layers=...) as its value")
        if not caches:
            raise ValueError(f"{kind} needs a cache or a non-empty mapping of name -> cache (or one-cache "
                             f"StepContext), got {caches!r}")
        self._init_step_state(kind)
        self.cache, self.attendance = None, None
        contexts: Dict[Hashable, StepContext] = {}
        for name, c in caches.items():
            if isinstance(c, MultiStepContext):
                raise ValueError(f"{kind}: {name!r} is a context over several caches; give its caches one name each")
            ctx = c if isinstance(c, StepContext) else StepContext(c)
            same = next((n for n, o in contexts.items() if o.cache is ctx.cache), None)
            if same is not None:
                raise ValueError(
                    f"{kind}: caches {same!r} and {name!r} are the same cache object; each name needs a "
                    f"cache of its own (two names over one cache would write every step to it twice)"
                )
            contexts[name] = ctx
        self.contexts = contexts

    def _the_cache(self, what: str) -> None:
        raise ValueError(f"{type(self).__name__}.{what}: this context steps the caches {list(self.contexts)}; "
                         f"call it on one of them, context[name].{what}")

    def _named_steps(self, step, where: str) -> dict:
        self.check_steps(step, where)
        return step

    def _refused(self, exc: BaseException, name, where: str) -> None:
        if isinstance(exc, SlotsExhausted):
            raise SlotsExhausted(f"{where}: cache {name!r} has no free slot for the step's new requests ({exc}); "
                                 f"the step was admitted in no cache") from exc
        raise named_error(exc, name, where) from None

    def _surface(self, per_cache: dict):
        return per_cache

    def bind(self, plan) -> None:
        for name, ctx in self.contexts.items():
            ctx.plan = plan[name]

    def attend(self, layer_idx, q, k, v, *, plan=None, **kwargs):
        self._the_cache("attend")

    __call__ = attend

    def check_attendance(self, where: Optional[str] = None) -> None:
        where = where or f"{type(self).__name__}.commit"
        for name, ctx in self.contexts.items():
            ctx.attendance.check(f"{where} (cache {name!r})", ctx._attending)

    def __repr__(self):
        named = ", ".join(f"{n!r}: {type(c.cache).__name__}" for n, c in self.contexts.items())
        return f"{type(self).__name__}({named})"
