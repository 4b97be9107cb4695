"""Query-only tokens: queries that read a row's cells in a step but write no key or value.

Some streaming models ask a question of the cache that is not one of the
step's own tokens: an Emformer-style encoder forms a summary of each segment
whose query attends the segment and its left context, and whose output
becomes a memory entry elsewhere, but which is never a key of the segment's
cache itself. `attend_query_only(..., q2)` serves such queries in the same
call as the step's own tokens, so they always see the step's writes:

- each query of `q2` (`[N, Hq, Q, D]`, any `Q`) attends exactly the cells the
  row's **newest own token** attends (the step token with the largest stream
  index: `span - 1` in stream order, `0` under `reverse_step_order`), after the
  step's write;
- a `score_mod` sees that token's position as the query's (stream or
  in-cache, as `positions` says), and learned `sinks` join its softmax as they
  join the step's;
- it runs on the rows path (`flexkv.cache.paths.rows_path`), eager or compiled,
  whatever path the step's own queries take; the output is `[N, Hq, Q, Dv]`
  with its log-sum-exp `[N, Hq, Q]`, after the step's own queries'.

Nothing is written for them and the plan is the step's: a query-only query
costs one more rows-path attention over the row's cells.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..positions.masks import make_score_mod, store_mask_mod
from .sinks import apply_learned_sinks

__all__ = ["check_query_only", "attend_query_only"]


def check_query_only(q2, q: torch.Tensor) -> None:
    """Raise `ValueError` unless `q2` is a `[N, Hq, Q, D]` tensor like the step's queries `q` but for `Q`."""
    if not isinstance(q2, torch.Tensor) or q2.dim() != 4:
        got = tuple(q2.shape) if isinstance(q2, torch.Tensor) else type(q2).__name__
        raise ValueError(f"attend: query_only must be a 4-D tensor [N, heads, Q, head_dim], got {got}")
    N, Hq, _, D = q.shape
    if (q2.shape[0], q2.shape[1], q2.shape[3]) != (N, Hq, D) or q2.shape[2] < 1:
        raise ValueError(f"attend: query_only must be [N={N}, heads={Hq}, Q>=1, head_dim={D}] like q, "
                         f"got {tuple(q2.shape)}")
    if q2.dtype != q.dtype or q2.device != q.device:
        raise ValueError(f"attend: query_only must have q's dtype and device ({q.dtype}, {q.device}), "
                         f"got {q2.dtype}, {q2.device}")


def newest_token(plan, reverse: bool) -> torch.Tensor:
    """`[N]`: the step index of each row's newest own token."""
    return torch.zeros_like(plan.span) if reverse else (plan.span - 1).clamp_min(0)


def attend_query_only(rows, q2: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, plan, *, scale: float,
                      score_mod: Optional[Callable], positions: str, sinks: Optional[torch.Tensor],
                      want_lse: bool, scales=None):
    """`(out [N, Hq, Q, Dv], lse [N, Hq, Q] or None)` of the query-only queries `q2` (module docstring)
    over layer cells `kc`, `vc` (as stored; `scales` for quantized cells) of the step `plan`, on the
    cache's rows path `rows` (`flexkv.cache.paths.rows_path.RowsPath`, over its store)."""
    store = rows.store
    c, lay = store.config, store.layout
    N, Hq, Q, D = q2.shape
    H = kc.shape[1]
    g = Hq // H
    T = plan.tokens
    newest = newest_token(plan, c.reverse_step_order)
    base = store_mask_mod(store, plan, T, False)

    def mask_mod(b, h, q_idx, kv_idx):
        return base(b, h, newest[b] + q_idx * 0, kv_idx)

    sm = None
    if score_mod is not None:
        inner = make_score_mod(plan, lay.ring_len, T, score_mod, positions, c.reverse_step_order, c.query_window)

        def sm(score, b, h, q_idx, kv_idx):
            # Queries are packed group-major: query head h * g + q_idx // Q, all at the newest token.
            return inner(score, b, h * g + q_idx // Q, newest[b] + q_idx * 0, kv_idx)

    qs = (q2 * scale).reshape(N, H, g * Q, D)
    geometry = None
    if not torch.compiler.is_compiling():
        # Eagerly, built once per plan and shared by every layer (`LayerStore.per_plan`).
        state, key = store.per_plan(plan), ("query_only", g * Q, T, qs.dtype)
        geometry = state.get(key)
        if geometry is None:
            geometry = state[key] = rows.geometry(plan, mask_mod, g * Q, qs.dtype)
    need_lse = want_lse or sinks is not None
    res = rows.attend(None, qs, kc, vc, plan, mask_mod, sm, lse=need_lse, geometry=geometry, scales=scales,
                      compiling=torch.compiler.is_compiling(), buffers=False)
    out, lse = res if need_lse else (res, None)
    out = out.reshape(N, Hq, Q, vc.shape[-1])
    if lse is not None:
        lse = lse.reshape(N, Hq, Q)
    if sinks is not None:
        out = apply_learned_sinks(out, lse, sinks)
        lse = torch.logaddexp(lse, sinks.to(lse.dtype).view(1, Hq, 1))
    return out, lse if want_lse else None
