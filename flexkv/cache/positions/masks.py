"""Retention as FlexAttention `mask_mod`/`score_mod` over the logical stream index.

Every physical key cell maps to the stream index it holds for a given row
(or to none), using only the plan's per-row tensors and two constants, the
ring length and the step's `T`. The mask is then docs/contract.md section 2 written on
stream indices; it is exact on its own (eager FlexAttention evaluates it on
every cell), and the plan's block lists only skip blocks where it is false.

A user `score_mod(score, b, h, q_pos, kv_pos)` sees positions instead of
cells: stream indices (`positions="stream"`) or in-cache positions
(`positions="cache"`: sinks keep theirs, everything after them shifts down
by the number of evicted entries), with `b` the flat row and `h` the query
head.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..host.planner import MASK_INTERVALS

__all__ = ["stream_index", "query_window_attends", "make_mask_mod", "store_mask_mod", "make_score_mod", "POSITION_MODES"]

POSITION_MODES = ("stream", "cache")


def stream_index(plan, ring_len: int, tokens: int, b, kv_idx):
    """(valid, j): whether cell `kv_idx` holds an entry of row `b`'s stream, and its index."""
    src_base = plan.src_base[b]
    src_len = plan.src_len[b]
    sink_base = plan.sink_base[b]
    ring_start = plan.ring_start[b]
    n = plan.n[b]

    rel_src = kv_idx - src_base
    in_src = (rel_src >= 0) & (rel_src < src_len)

    rel_sink = kv_idx - sink_base
    in_sink = (rel_sink >= 0) & (rel_sink < ring_start - src_len)

    cell = kv_idx - plan.ring_base[b]
    d = cell - plan.n_mod[b]
    d = torch.where(d < 0, d + ring_len, d)
    j_ring = torch.where(d < tokens, n + d, n + d - ring_len)
    in_ring = (cell >= 0) & (cell < ring_len) & (j_ring >= ring_start)

    j = torch.where(in_src, rel_src, torch.where(in_sink, src_len + rel_sink, j_ring))
    return in_src | in_sink | in_ring, j


def query_window_attends(j, p, sink, window):
    """Whether the query at stream index `p` attends entry `j` under a per-query window (contract
    section 2): `j <= p`, and `j` is a sink (`j < sink`) or one of the `window` entries before `p`.

    Works on ints and on tensors (broadcast); `sink` and `window` may be either too.
    """
    return (j <= p) & ((j >= p - window) | (j < sink))


def make_mask_mod(plan, ring_len: int, tokens: int, query_window: Optional[int], pack_gqa: bool = False,
                  causal_step: bool = False):
    """The retention mask of contract section 2 for `plan` (per-step or per-query window).

    `pack_gqa`: the query axis holds `group * tokens` queries (a GQA group folded into
    it, group-major), so the step's token is `q_idx % tokens`. `causal_step`: a
    per-step window that is causal inside the step (no query reads a later own token).
    """

    if query_window is None:
        # Every query of a row attends the same cells: the planner's cell intervals (at most
        # MASK_INTERVALS of them for a per-step window), a few comparisons per score.
        bounds = [(getattr(plan, f"cell_lo{k}"), getattr(plan, f"cell_hi{k}")) for k in range(MASK_INTERVALS)]

        def in_intervals(b, kv_idx):
            lo, hi = bounds[0]
            ok = (kv_idx >= lo[b]) & (kv_idx < hi[b])
            for lo, hi in bounds[1:]:
                ok = ok | ((kv_idx >= lo[b]) & (kv_idx < hi[b]))
            return ok

        if not causal_step:
            def mask_mod(b, h, q_idx, kv_idx):
                return in_intervals(b, kv_idx)
        else:
            def mask_mod(b, h, q_idx, kv_idx):
                # The intervals hold the shared window and every own token; a query drops the own
                # tokens after it (only those have stream indices past its own).
                _, j = stream_index(plan, ring_len, tokens, b, kv_idx)
                p = plan.n[b] + (q_idx % tokens if pack_gqa else q_idx)
                return in_intervals(b, kv_idx) & (j <= p)

    else:

        def mask_mod(b, h, q_idx, kv_idx):
            valid, j = stream_index(plan, ring_len, tokens, b, kv_idx)
            p = plan.n[b] + (q_idx % tokens if pack_gqa else q_idx)
            return valid & query_window_attends(j, p, plan.sink[b], query_window)

    return mask_mod


def store_mask_mod(store, plan, tokens: int, pack_gqa: bool = False) -> Callable:
    """The step's retention `mask_mod` over `store`'s cells (a `flexkv.cache.storage.store.LayerStore`: its
    layout's ring and its config's window and step shape); the one place every path builds it."""
    return make_mask_mod(plan, store.layout.ring_len, tokens, store.config.query_window, pack_gqa=pack_gqa,
                         causal_step=store.config.causal_step)


def query_stream_index(plan, b, q_idx, reverse: bool):
    """Stream index of query `q_idx` of row `b`."""
    n = plan.n[b]
    if not reverse:
        return n + q_idx
    span = plan.span[b]
    return torch.where(q_idx < span, n + span - 1 - q_idx, n + q_idx)


def make_score_mod(
    plan,
    ring_len: int,
    tokens: int,
    user: Callable,
    positions: str,
    reverse: bool,
    query_window: Optional[int],
    group: int = 1,
    query_index: bool = False,
):
    """Wrap `user(score, b, h, q_pos, kv_pos)` so it receives positions, not cells.

    `group > 1`: queries are packed (`pack_gqa` in `make_mask_mod`); the user still sees the
    query head `h * group + q_idx // tokens`. `query_index`: call `user(score, b, h, t, q_pos,
    kv_pos)` with the query's token `t` in the step as well (`RelativePositionScores.at`).
    """
    if positions not in POSITION_MODES:
        raise ValueError(f"positions must be one of {POSITION_MODES}, got {positions!r}")

    def score_mod(score, b, h, q_idx, kv_idx):
        return at_stream_index(score, b, h, q_idx, stream_index(plan, ring_len, tokens, b, kv_idx)[1])

    def at_stream_index(score, b, h, q_idx, j):
        """The same, for cells whose stream indices `j` the caller already has (the rows path's geometry)."""
        if group > 1:
            h = h * group + q_idx // tokens
            q_idx = q_idx % tokens
        qp = query_stream_index(plan, b, q_idx, reverse)
        if positions == "cache":
            s = plan.sink[b]
            if query_window is None:
                evicted = plan.lo[b] - s
            else:
                e = plan.n[b] + q_idx - query_window - s
                evicted = torch.where(e > 0, e, 0)
            j = torch.where(j < s, j, j - evicted)
            qp = torch.where(qp < s, qp, qp - evicted)
        if query_index:
            return user(score, b, h, q_idx, qp, j)
        return user(score, b, h, qp, j)

    score_mod.at_stream_index = at_stream_index
    return score_mod
