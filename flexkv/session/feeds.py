"""What requests feed a session step, and how the feeds of a step become one padded batch.

A feed is a tensor, or a nested tuple, list or dict of tensors, with the
request's tokens along dimension 0; `Chunk(inputs, span=k)` writes only the
first `k`. Feeds are taken apart and put back together with torch's own
pytree functions (`torch.utils._pytree`), so the model function receives the
structure one request fed, each tensor stacked by lane into `[B, T, ...]`.
Per-request model state goes through the same functions, stacked `[B, ...]`.
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, List, Mapping, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from ..config import is_int

__all__ = ["Chunk", "PerRequest", "Feed", "flatten", "feed_leaves", "unflatten", "map_tensors", "parse_feed",
           "parse_feeds", "pad_by_lane"]


class Chunk(NamedTuple):
    """What one request feeds a step when it does not write all of it.

    `inputs`: a tensor, or a tuple, list or dict of tensors, with the chunk's
    tokens along dimension 0. `span`: how many of them are written to the
    stream (default: all); the remaining ones are look-ahead tokens, attended
    but never written (a conformer's right context, a TTS model's last chunk
    with `span=0`).
    """

    inputs: Any
    span: Optional[int] = None


class PerRequest(NamedTuple):
    """A tensor of a feed that belongs to the request, not to its tokens (a speaker embedding, a style
    vector): no token dimension; the model function receives it stacked by lane, `[B, ...]`, where it
    receives the feed's other tensors `[B, T, ...]`. Place it anywhere in the feed's structure:
    `{"a": (noise, tokens, PerRequest(speaker))}`."""

    value: torch.Tensor


class Feed(NamedTuple):
    """One request's feed, checked: its tensors, their structure, how many tokens, how many it writes,
    and which tensors are per request (`PerRequest`, no token dimension)."""

    leaves: List[torch.Tensor]
    spec: Any
    tokens: int
    span: int
    per_request: Tuple[bool, ...] = ()

    @property
    def signature(self) -> tuple:
        """The structure, trailing shapes, dtypes and devices every feed of a step must share."""
        return self.spec, tuple((tuple(t.shape if whole else t.shape[1:]), t.dtype, t.device, whole)
                                for t, whole in zip(self.leaves, self.per_request or (False,) * len(self.leaves)))


def flatten(x, where: str) -> Tuple[List[torch.Tensor], Any]:
    """The tensors of `x` (a tensor or a nested tuple/list/dict of tensors) and its structure."""
    paths, spec = pytree.tree_flatten_with_path(x)
    for path, leaf in paths:
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(
                f"{where}{pytree.keystr(path)} must be a tensor or a tuple, list or dict of tensors, "
                f"got {type(leaf).__name__}"
            )
    return [leaf for _, leaf in paths], spec


def feed_leaves(x, where: str) -> Tuple[List[torch.Tensor], Any, Tuple[bool, ...]]:
    """`flatten` for a feed: its tensors (a `PerRequest` unwrapped), structure, and which are per request."""
    paths, spec = pytree.tree_flatten_with_path(x, is_leaf=lambda v: isinstance(v, PerRequest))
    leaves, per_request = [], []
    for path, leaf in paths:
        whole = isinstance(leaf, PerRequest)
        value = leaf.value if whole else leaf
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{where}{pytree.keystr(path)} must be a tensor or a tuple, list or dict of tensors (a tensor "
                f"without tokens as PerRequest(tensor)), got {type(value).__name__}"
            )
        leaves.append(value)
        per_request.append(whole)
    return leaves, spec, tuple(per_request)


def unflatten(spec, leaves: Sequence[torch.Tensor]):
    """`flatten`'s inverse."""
    return pytree.tree_unflatten(list(leaves), spec)


def map_tensors(fn, x):
    """`fn` applied to every tensor of a (nested) structure; other values are kept."""
    return pytree.tree_map_only(torch.Tensor, fn, x)


def parse_feed(request_id, feed, largest: int) -> Feed:
    """Check one request's feed (`largest`: the most tokens a step may carry) and take it apart."""
    inputs, span = (feed.inputs, feed.span) if isinstance(feed, Chunk) else (feed, None)
    leaves, spec, per_request = feed_leaves(inputs, f"the feed of request {request_id!r}")
    tokens = [t for t, whole in zip(leaves, per_request) if not whole]
    if not tokens:
        raise ValueError(f"the feed of request {request_id!r} holds no tensor with tokens (only PerRequest ones)")
    n = tokens[0].shape[0] if tokens[0].dim() else 0
    for t in tokens:
        if t.dim() == 0 or t.shape[0] != n:
            raise ValueError(
                f"request {request_id!r}: every tensor it feeds needs its tokens along dim 0, and they disagree "
                f"(shapes {[tuple(x.shape) for x in leaves]})"
            )
    if n < 1:
        raise ValueError(f"request {request_id!r} feeds no token; feed at least one (or leave it out)")
    if n > largest:
        raise ValueError(
            f"request {request_id!r} feeds {n} tokens, more than the largest token size {largest}; split the feed "
            f"into chunks of at most {largest} or raise token_sizes (and max_step_tokens)"
        )
    if span is None:
        span = n
    if not is_int(span) or not 0 <= span <= n:
        raise ValueError(f"request {request_id!r}: Chunk span must be an int in [0, {n}] (tokens fed), got {span!r}")
    return Feed(leaves, spec, n, span, per_request)


def parse_feeds(feeds, token_sizes: Mapping[Hashable, Tuple[int, ...]],
                one: bool) -> Dict[Hashable, Dict[Hashable, Feed]]:
    """A step's feeds, checked and taken apart: request id -> cache name -> `Feed`.

    `token_sizes` names the session's caches (each with its token buckets). `one`: a one-cache
    session, whose requests feed its cache directly; otherwise each request feeds a mapping with one
    feed per cache. Every request must feed each cache the same structure, trailing shapes and dtypes.
    """
    names = list(token_sizes)
    if not isinstance(feeds, Mapping) or not feeds:
        raise ValueError("feeds must be a non-empty mapping of request id -> "
                         + ("tokens (or Chunk)" if one else "{cache name: tokens (or Chunk)}"))
    parsed: Dict[Hashable, Dict[Hashable, Feed]] = {}
    for rid, feed in feeds.items():
        if one:
            parsed[rid] = {names[0]: parse_feed(rid, feed, token_sizes[names[0]][-1])}
            continue
        if not isinstance(feed, Mapping) or set(feed) != set(names):
            got = list(feed) if isinstance(feed, Mapping) else type(feed).__name__
            raise ValueError(f"request {rid!r} must feed a mapping with one feed per cache, named {names} (each "
                             f"cache has its own step length), got {got}")
        parsed[rid] = {}
        for name in names:
            try:
                parsed[rid][name] = parse_feed(rid, feed[name], token_sizes[name][-1])
            except ValueError as exc:
                raise ValueError(f"cache {name!r}: {exc}") from None
    first = next(iter(parsed))
    for name in names:
        sig = parsed[first][name].signature
        for rid, feed in parsed.items():
            s = feed[name].signature
            if s == sig:
                continue
            if one:
                raise ValueError(
                    f"requests {first!r} and {rid!r} feed differently shaped inputs ({sig[1]} vs {s[1]} after the "
                    f"token dim); every request of a step must feed the same structure, trailing shapes and dtypes"
                )
            raise ValueError(
                f"requests {first!r} and {rid!r} feed cache {name!r} differently shaped inputs; every request of a "
                f"step must feed each cache the same structure, trailing shapes and dtypes"
            )
    return parsed


def pad_by_lane(per_lane: Dict[int, Sequence[torch.Tensor]], template: Sequence[torch.Tensor], B: int,
                T: Optional[int], per_request: Sequence[bool] = ()) -> List[torch.Tensor]:
    """Stack per-lane leaves into `[B, T, ...]` (or `[B, ...]` with `T` None, or for a leaf marked in
    `per_request`), zeros where a lane has nothing or fewer tokens."""
    out = []
    whole = tuple(per_request) or (False,) * len(template)
    for i, t in enumerate(template):
        if whole[i]:
            out.extend(pad_by_lane({lane: (leaves[i],) for lane, leaves in per_lane.items()}, (t,), B, None))
            continue
        rows = [per_lane.get(lane) for lane in range(B)]
        if all(r is not None and (T is None or r[i].shape[0] == T) for r in rows):
            out.append(torch.stack([r[i] for r in rows]))
            continue
        shape = (B,) + ((T,) + tuple(t.shape[1:]) if T is not None else tuple(t.shape))
        batch = torch.zeros(shape, dtype=t.dtype, device=t.device)
        for lane, leaves in per_lane.items():
            x = leaves[i]
            if T is None:
                batch[lane] = x
            else:
                batch[lane, :x.shape[0]] = x
        out.append(batch)
    return out
