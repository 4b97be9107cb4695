"""`attend`'s four modes as four methods, each with one result type (`AttendModes`), over one `_attend`.

A cache's attention for a planned step comes in four forms:

- `attend(...)`: the output `[N, Hq, T, Dv]`, a tensor;
- `attend_lse(...)`: `Attended(out, lse)`, with each query's log-sum-exp
  `[N, Hq, T]`, so that attention over this cache and over other keys can be
  joined into one softmax exactly (`flexkv.cache.paths.merge.merge_attention`);
- `attend_query_only(..., query_only)`: also queries `[N, Hq, Q, D]` that write
  nothing and read what each row's newest own token reads: `Attended` over the
  `T + Q` queries (the step's own first, then the query-only ones);
- `attend_joined(..., parts, query_only=None)`: keys and values kept elsewhere
  (`KeyPart`s) join every query's softmax: `Attended` over the `T` (+ `Q`)
  queries.

A cache defines `_attend(layer_idx, q, k, v, plan, *, scale, score_mod,
positions, sinks, want_lse, query_only, joined)`, returning the output, or
`Attended` over every query with `want_lse`; the modes are this mixin's.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

__all__ = ["AttendModes", "Attended"]


class Attended(NamedTuple):
    """An attention output and the natural-log sum of exp of each query's scores (at least float32; a learned
    sink's logit included; `-inf` where a query reads nothing)."""

    #: `[N, Hq, Q, Dv]`
    out: torch.Tensor
    #: `[N, Hq, Q]`
    lse: torch.Tensor


class AttendModes:
    """`attend`, `attend_lse`, `attend_query_only` and `attend_joined` over the class's `_attend`."""

    def _attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any, *,
                scale: Optional[float], score_mod: Optional[Callable], positions: str,
                sinks: Optional[torch.Tensor], want_lse: bool, query_only: Optional[torch.Tensor],
                joined: Optional[Sequence]):
        raise NotImplementedError  # an abstract hook: each cache class defines it

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any, *,
               scale: Optional[float] = None, score_mod: Optional[Callable] = None, positions: str = "stream",
               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Write the step's tokens into layer `layer_idx` and attend over what each row may read: `[N, Hq, T,
        Dv]` (`flexkv.cache.cache_group.CacheGroup._attend` describes the arguments)."""
        return self._attend(layer_idx, q, k, v, plan, scale=scale, score_mod=score_mod, positions=positions,
                            sinks=sinks, want_lse=False, query_only=None, joined=None)

    def attend_lse(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any, *,
                   scale: Optional[float] = None, score_mod: Optional[Callable] = None, positions: str = "stream",
                   sinks: Optional[torch.Tensor] = None) -> Attended:
        """`attend`, with each query's log-sum-exp: `Attended(out, lse)`."""
        return self._attend(layer_idx, q, k, v, plan, scale=scale, score_mod=score_mod, positions=positions,
                            sinks=sinks, want_lse=True, query_only=None, joined=None)

    def attend_query_only(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any,
                          query_only: torch.Tensor, *, scale: Optional[float] = None,
                          score_mod: Optional[Callable] = None, positions: str = "stream",
                          sinks: Optional[torch.Tensor] = None) -> Attended:
        """`attend_lse`, and `query_only` `[N, Hq, Q, D]` queries that write nothing and attend what each row's
        newest own token attends: `Attended` over `T + Q` queries (the step's `T` first)."""
        return self._attend(layer_idx, q, k, v, plan, scale=scale, score_mod=score_mod, positions=positions,
                            sinks=sinks, want_lse=True, query_only=query_only, joined=None)

    def attend_joined(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any,
                      parts: Sequence, *, query_only: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                      sinks: Optional[torch.Tensor] = None) -> Attended:
        """`attend_lse` (or `attend_query_only` with `query_only`) with `parts`, `KeyPart`s kept elsewhere (another
        cache's `write_part`, keys recomputed every step), in every query's softmax: `Attended` over the `T`
        (+ `Q`) queries. No `score_mod` (`flexkv.cache.paths.joint_path`)."""
        return self._attend(layer_idx, q, k, v, plan, scale=scale, score_mod=None, positions="stream", sinks=sinks,
                            want_lse=True, query_only=query_only, joined=parts)
