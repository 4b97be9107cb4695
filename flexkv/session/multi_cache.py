"""`MultiCacheSession`: the step loop of a model that keeps several caches.

A streaming speech encoder with two attention stacks at different frame
rates (25 and 50 frames per chunk), each stack with its own cache (its own
`BoundedKVConfig`: layers, heads, retention, `max_step_tokens`), runs each
chunk as one model step over both caches. `MultiCacheSession` is
`StreamSession`'s loop for such a model, over a mapping of named caches,
stepped together through one `flexkv.model.multi_context.MultiStepContext`
(one `flexkv.cache.host.transaction.StepTransaction` over every cache):

    session = MultiCacheSession({"slow": config_25, "fast": config_50})
    out = session.step({"utt0": {"slow": x25, "fast": x50}}, fn)
    out["utt0"]["fast"]     # fn's "fast" output cut to utt0's lane and tokens

A cache may hold sources: a flow-matching decoder's cache ("dit") reading a
voice prompt shared by every request in that voice, beside two encoder
caches without any:

    voice = session.add_source("dit", prompt_keys, prompt_values)
    session.start("utt1", sources={"dit": (voice, prompt_len)})

What differs from `StreamSession`:

- A feed is, per request, a mapping of cache name -> that cache's feed
  (a tensor or structure of tensors with the tokens along dim 0, or a
  `Chunk`), every cache named: each cache gets its own step length per
  request and its own padded `T` (the smallest of its `token_sizes` that
  holds the step's feeds for it).
- `fn(attn, inputs)`: `attn` is the session's `MultiStepContext`,
  `attn[name]` each cache's `StepContext` (call it, `attn[name](layer, q,
  k, v)`, or build the model's attention on `session.context[name]` with
  `flexkv.model.wrap.attention` / `flexkv.swap_attention`); `inputs` maps
  each cache name to its padded `[B, T_name, ...]` inputs. With
  `initial_state`, `fn(attn, inputs, state)` returns `(outputs,
  new_state)`, as in `StreamSession`.
- A request holds one lane (its batch row, the same in every cache) and one
  slot in every cache; its written count is per cache (`written(id)` maps
  each name to it). Every cache must have the same `max_slots`: a lane
  without a slot in some cache could not run, a slot without a lane would
  never be used.
- Sources live in one cache each, so every source call names its cache:
  `add_source(name, keys, values) -> index`, `remove_source(name, index)`,
  `add_private_source(name, id, keys, values)`,
  `remove_private_source(name, id)` (`StreamSession`'s, with the cache name
  first). A request declares a source per cache when it starts,
  `start(id, sources={name: (source, source_len)})` (`source=-1` its
  private source in that cache); a cache not named starts on an empty
  stream without a source, and `step` starts new requests without any.
  `reset(id, sources={...})` changes the named caches' declarations and
  keeps the others'; `sources(id)` maps every cache to its `(source,
  source_len)`. A waiting request keeps its declarations, and
  `remove_source` / `remove_private_source` refuse a source a waiting
  request declared; `fork` carries every cache's source; `finish` frees
  the request's private sources in every cache.
- `rollback(id, {name: tokens})` names every cache (0 to keep one as it is).

What it keeps: every operation happens in every cache or in none. A step is
one transaction: its admissions (a request admitted in every cache or in
none; a cache that refuses is named), its plans, the attendance check of
every cache's every declared layer, then the commits, so a step that fails
anywhere (bad input, a model error, `KeyboardInterrupt`, a layer never
attended) leaves every cache, lane and waiting request as it was. `finish`,
`reset`, `fork` and `rollback` check every cache first, then change all of
them. Lanes, padding, buckets (`batch_sizes`; `token_sizes` per cache),
queueing (`when_full`), compiling once per bucket (`compile=True`: every
`(B, T of each cache)` at warm-up; a later compile warns with the guard
that failed) and the one-operation-at-a-time rule are `StreamSession`'s:
`MultiCacheSession` is `StreamSession` over named caches
(`StreamSession({"slow": config_25, "fast": config_50})` builds one), and
holds only what differs at the surface.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, Optional, Sequence

from ..cache.host.slots import SlotsExhausted
from ..config import is_int
from ..model.step_context import named_error, naming_errors
from .feeds import parse_feeds
from .lanes import declarations, source_call
from .result import step_result
from .stream_session import StreamSession

__all__ = ["MultiCacheSession"]


class MultiCacheSession(StreamSession, named_shape=True):
    """`StreamSession` over named caches stepped as one (see the module docstring).

    Sources live in one cache each: `add_source(cache_name, keys, values)`
    returns the source's index in that cache, and a request reads it with
    `start(request_id, sources={cache_name: (index, source_len)})` (or
    `(-1, source_len)` after `add_private_source(cache_name, request_id,
    keys, values)`); caches not named start without a source.
    `reset(request_id, sources={...})` changes only the caches named;
    `remove_source(cache_name, index)`, `remove_private_source(cache_name,
    request_id)` and `sources(request_id)` complete the set.

    Args:
        caches: a non-empty mapping of name -> `BoundedKVConfig` (the session
            builds a `BoundedKVManager` on `device`) or a flexkv cache of the
            session's own (`flexkv.cache.protocol.StreamCache`, holding no
            request: a `BoundedKVManager` with layer groups, an
            `UncachedHistory` for checking with `compile=False`). Every cache
            needs the same `max_slots`.
        batch_sizes: the batch sizes `B` a step is padded to (default
            `(max_slots,)`; the largest must be `max_slots`).
        token_sizes: name -> the token counts a cache's step is padded to
            (default per cache `(1, max_step_tokens)`); a cache left out
            keeps its default.
        when_full, compile, initial_state: as `StreamSession`.
        block_size: FlexAttention's KV block size of the caches built from configs.

    What differs from a one-cache session is this class's, once: its surface takes and answers
    per cache (`_surface` keeps the mapping), errors name their cache, source calls take the cache's
    name first, and `rollback` takes tokens per cache.
    """

    def __init__(
        self,
        caches: Mapping[Hashable, Any],
        device="cpu",
        *,
        batch_sizes: Optional[Sequence[int]] = None,
        token_sizes: Optional[Mapping[Hashable, Sequence[int]]] = None,
        when_full: str = "queue",
        compile: bool = True,
        initial_state: Optional[Callable[..., Any]] = None,
        block_size: Optional[int] = None,
        groups=None,
    ):
        super().__init__(caches, device, groups=groups, batch_sizes=batch_sizes, token_sizes=token_sizes,
                         when_full=when_full, compile=compile, initial_state=initial_state, block_size=block_size)

    @property
    def cache(self):
        raise AttributeError(f"a {type(self).__name__} over named caches {list(self.caches)} has no one cache; "
                             f"use caches[name]")

    def _check_shape(self, cache) -> None:
        if not isinstance(cache, Mapping):
            raise ValueError(f"{type(self).__name__} takes a mapping of name -> cache, got {type(cache).__name__}; "
                             f"a session over one cache is StreamSession(cache)")

    def _surface(self, per_cache: dict):
        return per_cache

    def _parse_feeds(self, feeds):
        return parse_feeds(feeds, self._token_sizes, False)

    def _result(self, *args):
        return step_result(False, *args)

    def _source_call(self, what: str, args: tuple):
        return source_call(type(self).__name__, False, self.caches, what, args)

    def _declarations(self, what: str, base, source, source_len, sources):
        return declarations(type(self).__name__, what, False, base, source, source_len, sources)

    def _naming(self, name, where: Optional[str] = None):
        return naming_errors(name, where or type(self).__name__)

    def _in_cache(self, name, phrase: str) -> str:
        return phrase.format(name)

    def _refused(self, exc: BaseException, name, request_id) -> None:
        if isinstance(exc, SlotsExhausted):
            raise SlotsExhausted(
                f"cache {name!r} has no free slot for request {request_id!r} ({exc}); it is admitted in no cache"
            ) from exc
        raise named_error(exc, name, type(self).__name__) from None

    def _rollback_counts(self, tokens) -> dict:
        if not isinstance(tokens, Mapping) or set(tokens) != set(self.caches):
            raise ValueError(
                f"rollback: tokens must map every cache name {list(self.caches)} to the tokens to take back "
                f"from it (0 for none; each cache has its own step lengths), got {tokens!r}"
            )
        counts = dict(tokens)
        bad = next((n for n, k in counts.items() if not is_int(k) or k < 0), None)
        if bad is not None:
            raise ValueError(f"rollback: tokens[{bad!r}] must be an int >= 0, got {counts[bad]!r}")
        return counts

    def _templates(self, example) -> dict:
        parsed = parse_feeds({None: example}, self._token_sizes, False)[None]
        return {name: (f.leaves, f.spec, f.per_request) for name, f in parsed.items()}
