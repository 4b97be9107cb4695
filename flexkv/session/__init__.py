"""`StreamSession`: the step loop of a streaming model, written once.

This docstring is the session's one full description; README.md's
quickstart and `examples/quickstart.py` show it in use, and
docs/contract.md section 5 is the lifecycle it runs. The package holds
what a request feeds (`feeds`), a step's result (`result`) and the session
itself (`stream_session`). A model that streams through a bounded cache
needs the same loop every time: keep each request's position, give new
requests a slot (or make them wait), pad the batch to a fixed shape so the
compiled step never recompiles, compile and warm up, then per step admit,
plan, run the model, commit. `StreamSession` is that loop.

What it does per `step(feeds, fn)`:

- `feeds` maps request ids to what each request feeds this step: a tensor
  (or a tuple, list or dict of tensors) with the request's tokens along
  dimension 0, or a `Chunk(inputs, span=k)` that writes only the first `k`
  tokens (the rest are look-ahead tokens: attended, never written). A request
  seen for the first time starts with an empty stream and no source;
  `start(request_id, source=i, source_len=L)` starts one on a shared source.
  A tensor that belongs to the request rather than its tokens (a speaker
  embedding) goes in the structure as `PerRequest(tensor)`: `fn` receives it
  `[B, ...]`, stacked by lane, without repeating it over the tokens.
- Each request holds a *lane*, its index in the model's batch, from its
  start until `finish()`: the lowest free lane, as stable as the request
  (its attention rows are `lane * R .. lane * R + R - 1` with
  `rows_per_request = R`; its slot in the cache is the cache's choice). The
  batch is padded to the smallest of `batch_sizes` that covers every lane in
  the step, and `T` to the smallest of `token_sizes` that holds every feed;
  padded lanes are padding segments (they read and write nothing).
- `fn(attn, inputs)` runs the model on the padded batch (`inputs` has the
  structure of one feed, each tensor `[B, T, ...]`); `attn(layer, q, k, v,
  **kw)` is the cache's attention for the step (`BoundedKVManager.attend`
  with the step's plan). `attn` is the session's `StepContext`, so modules
  built with `flexkv.model.wrap.attention(session.context, layer)` and
  models swapped with `flexkv.swap_attention(model, session.context, ...)`
  work too.
- The result (`StepResult`) maps each request of the step to its share of
  `fn`'s output: every output tensor `[B, T, ...]` cut to the request's lane
  and tokens.

With `compile=True` (the default) `fn` runs under
`torch.compile(fullgraph=True, dynamic=False)`, once per `(B, T)` bucket:
the first step (or `warmup`) compiles every bucket on all-padding steps,
and no later step compiles; one that does is reported with the guard that
failed (`flexkv.RecompileWarning`, `flexkv.RecompileError`). `fn` may be
`Stages(f0, f1, ...)`, a step in stages (one per layer, say), each compiled
as a graph of its own (`flexkv.session.step_functions`).
`initial_state` gives every request a model state carried between steps (a
convolution's last inputs, say); `fn` then takes and returns it (see
`StreamSession`). Warm-up builds the state of its padding rows with request
id `None` (`initial_state(None)`), so a per-request `initial_state` must
accept it.

When every lane is held, `when_full` decides: `"queue"` (default) keeps new
requests waiting, first come first served, and admits them as lanes free
up (their feeds are left out of steps meanwhile and listed in
`StepResult.waiting`); `"refuse"` raises `SlotsExhausted` and changes
nothing. A step starts a request it has not seen on an empty stream with no
source; a request given a private source is refused there and must be
`start`ed on it (`source=-1`).

Every retention the core has runs here: give `groups=` (LayerGroups, or
one `SinkWindow` per layer) for a model whose layers keep different parts
of the stream, or pass any flexkv cache (`flexkv.cache.protocol.StreamCache`: a
`BoundedKVManager`, or the uncached twin
`flexkv.model.uncached.UncachedHistory` for checking). The session uses the cache
only through that protocol, and adds no semantics of its own.

Every operation is atomic: it happens, or it raises and nothing changed
(the cache, every lane, every waiting request). That holds for a model
function that raises (`KeyboardInterrupt` included): a step is one
`flexkv.cache.host.transaction.StepTransaction`, so its tokens are not committed
and its new requests are not started. The one exception is
what `finish`, `reset` and `add_source` do next: handing freed lanes to
waiting requests. If starting one raises (its `initial_state` fails, an
interrupt), the operation itself has happened, that error is raised after
it, and the request keeps its place in the queue. The session needs a
cache of its own, holding no request when the session is built. A session is not
thread-safe and not re-entrant: an operation called while another runs
(from another thread, or from inside the model function) raises
`RuntimeError` and changes nothing.

A model that keeps several caches in one step (two attention stacks at
different frame rates, each with a cache of its own) runs through the same
session over a mapping of named caches, `StreamSession({"slow": ...,
"fast": ...})`, which builds a `MultiCacheSession` (`flexkv.session.multi_cache`,
the subclass holding what differs at the surface): each request feeding every cache its own
tokens, and every operation applied to every cache or to none. Its sources
live in one cache each: `add_source(cache_name, keys, values)`, and
`start(request_id, sources={cache_name: (source, source_len)})`.
"""

from .feeds import Chunk, PerRequest
from .multi_cache import MultiCacheSession
from .result import MultiStepResult, StepResult
from .step_functions import Stages
from .stream_session import WHEN_FULL, StreamSession

__all__ = ["StreamSession", "MultiCacheSession", "Chunk", "PerRequest", "Stages", "StepResult", "MultiStepResult",
           "WHEN_FULL"]
