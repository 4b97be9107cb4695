"""`StreamSession`: the step loop of a streaming model, written once.

A model that streams through a bounded cache needs the same loop every
time: keep each request's position, give new requests a slot (or make them
wait), pad the batch to a fixed shape so the compiled step never
recompiles, compile and warm up, then per step admit, plan, run the model,
commit. `StreamSession` is that loop::

    session = StreamSession(config)                 # or an existing BoundedKVManager

    def model(attn, tokens):                        # tokens [B, T]: every request's, padded
        x = embed(tokens)
        for layer in range(num_layers):
            q, k, v = project(layer, x)             # [B, heads, T, head_dim]
            x = x + out_proj(layer, attn(layer, q, k, v))
        return logits(x)                            # [B, T, vocab]

    out = session.step({"chat0": prompt_ids, "chat1": next_id}, model)
    out["chat0"]                                    # chat0's logits, [len(prompt_ids), vocab]
    session.finish("chat0")                         # its slot goes to the next request

What it does per `step(feeds, fn)`:

- `feeds` maps request ids to what each request feeds this step: a tensor
  (or a tuple, list or dict of tensors) with the request's tokens along
  dimension 0, or a `Chunk(inputs, span=k)` that writes only the first `k`
  tokens (the rest are look-ahead tokens: attended, never written). A request
  seen for the first time starts with an empty stream and no source;
  `start()` starts one on a shared source.
- Each request holds a *lane*, its row in the batch (`rows_per_request` rows
  with CFG), from its start until `finish()`: the lowest free lane, as
  stable as the request. The batch is padded to the smallest of
  `batch_sizes` that covers every lane in the step, and `T` to the smallest of
  `token_sizes` that holds every feed; padded lanes are padding segments
  (they read and write nothing).
- `fn(attn, inputs)` runs the model on the padded batch (`inputs` has the
  structure of one feed, each tensor `[B, T, ...]`); `attn(layer, q, k, v,
  **kw)` is the cache's attention for the step (`BoundedKVManager.attend`
  with the step's plan). `attn` is the session's `StepContext`, so modules
  built with `flexkv.model.wrap.attention(session.context, layer)` work too.
- The result maps each request of the step to its share of `fn`'s output:
  every output tensor `[B, T, ...]` cut to the request's lane and tokens.

With `compile=True` (the default) `fn` runs under
`torch.compile(fullgraph=True, dynamic=False)`, once per `(B, T)` bucket:
the first step (or `warmup`) compiles every bucket on all-padding steps,
and no later step compiles. `initial_state` gives every request a model state
carried between steps (a convolution's last inputs, say); `fn` then takes
and returns it (see `StreamSession`).

When every lane is held, `when_full` decides: `"queue"` (default) keeps new
requests waiting, first come first served, and admits them as lanes free
up (their feeds are left out of steps meanwhile and listed in
`StepResult.waiting`); `"refuse"` raises `SlotsExhausted` and changes
nothing.

Every retention the core has runs here: give `groups=` (LayerGroups, or
one `SinkWindow` per layer) for a model whose layers keep different parts
of the stream, or pass any flexkv cache (`flexkv.cache.protocol.StreamCache`: a
`BoundedKVManager`, a `GroupedKVManager`, or the uncached twin
`flexkv.model.uncached.UncachedHistory` for checking). The session uses the cache
only through that protocol, and adds no semantics of its own.

Every operation is atomic: it happens, or it raises and nothing changed
(the cache, every lane, every waiting request). That holds for a model
function that raises (`KeyboardInterrupt` included): the step's tokens are
not committed and its new requests are not started. A session is not
thread-safe and not re-entrant: an operation called while another runs
(from another thread, or from inside the model function) raises
`RuntimeError` and changes nothing.

The low-level API (`admit`, `plan`, `attend`, `commit`) stays what an
engine uses; the session is built on it and on nothing else.
"""

from .feeds import Chunk
from .result import StepResult
from .stream_session import WHEN_FULL, StreamSession

__all__ = ["StreamSession", "Chunk", "StepResult", "WHEN_FULL"]
