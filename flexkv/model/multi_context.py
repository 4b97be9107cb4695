"""`MultiStepContext`: one model step over several caches, whole or not at all.

Some models keep more than one cache: a streaming speech encoder whose two
attention stacks run at different frame rates (25 and 50 frames per chunk),
each stack with its own layers, heads, retention and step length. A
`StepContext` over named caches steps them together in one
`flexkv.cache.host.transaction.StepTransaction`. `MultiStepContext` is that
class spelled for this use (a subclass that adds nothing), and
`multi[name]` is each cache's one-cache `StepContext`:

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

from .step_context import StepContext, named_error

__all__ = ["MultiStepContext", "named_error"]


class MultiStepContext(StepContext):
    """`StepContext` over named caches (module docstring), under the name of that use: `multi[name]`
    is each cache's one-cache `StepContext`.

    Args:
        caches: a non-empty mapping of name -> a flexkv cache
            (`flexkv.cache.protocol.StreamCache`) or a one-cache `StepContext`
            over one; every cache at most once.
    """
