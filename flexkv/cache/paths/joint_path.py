"""The joint path: a cache's cells and keys kept elsewhere, in one softmax.

Some layers attend, in one softmax, keys of several kinds kept under
different rules. Emformer's (a streaming speech encoder): a bank of the last
`M` memory entries, the segment's look-ahead (recomputed every segment), the
last `L` frames and the segment itself; its segment summary is a query that
reads all of them but the bank. On flexkv the frames are one cache, the bank
another (one entry a step, its own retention), the look-ahead plain tensors,
and each layer is one call:

    bank_part = bank.write_part(layer, k_entry, v_entry, bank_plan)     # the bank's write, its cells
    out, lse = frames.attend_joined(layer, q_seg, k_seg, v_seg, plan,
                                    (bank_part.for_queries(range(U + R)), KeyPart(k_ahead, v_ahead)),
                                    query_only=q_more)

The call's queries are its `T` own queries, then its `Q` query-only queries
(`flexkv.cache.paths.query_only`), `T + Q` in all. Each query's softmax runs over:

==================  ==========================================================
the cache's cells   what the query reads under the cache's retention (a
                    query-only query: what the row's newest own token reads),
                    after the step's write
each `KeyPart`      its keys of the row that exist (`valid`), if the query is
                    one of the part's `queries` (None: every query)
==================  ==========================================================

A padding row reads nothing, joined keys included (its output is zeros and
its log-sum-exp -inf, as in any path).

`write_part` is the other side: it writes a step's keys into a layer as
`attend` does and returns, as a `KeyPart`, the cells each row's newest own
token reads (`[N, H, W, D]` with `W = max_retained + max_step_tokens`, the
cells past a row's set marked not `valid`). A step that writes into one
cache and is read from another is how a bank joins the frames' softmax.

How: each row's cells are gathered side by side (as the rows path gathers
them), the parts' keys laid after them, and one
`scaled_dot_product_attention` runs over the lot with an additive mask
built once per step and per combination of parts, shared by every layer
(eagerly; a compiled step builds it in every layer). Scores need no
position: a `score_mod` is refused here, as are relative-position tables,
since a joined key has no place in the cache's stream.

Worked example (`tests/test_joint_path.py`): a row with `SinkWindow(1, 2)`
at 6 written entries writes 2 tokens (stream 6, 7); both read entries 0,
4, 5 and the step, 6 and 7 (5 cells), and a one-key part `KeyPart(k, v)`:
6 keys in one softmax, against 5 + 1 in two softmaxes merged.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn.functional as F

from ..positions.masks import store_mask_mod
from ..storage.quantized import SCALE_DTYPE
from .query_only import newest_token
from .row_attention import NEG_INF, gather_width, interval_cells
from .row_cells import batch_cells

__all__ = ["KeyPart", "JointPath", "check_joined", "joint_attention", "cells_part"]


class KeyPart(NamedTuple):
    """Keys and values that join an `attend` call's softmax (`attend_joined(..., (part, ...))`).

    `k`: `[N, H, K, head_dim]`, `v`: `[N, H, K, value_head_dim]` (the cache's heads, dtype and
    device; `N` the call's rows). `valid`: `[N, K]` bool, which of a row's keys exist (None: all).
    `queries`: the call's queries that read them, a `range` over its own `T` queries then its
    query-only `Q` queries (None: every query).
    """

    k: torch.Tensor
    v: torch.Tensor
    valid: Optional[torch.Tensor] = None
    queries: Optional[range] = None

    def for_queries(self, queries: range) -> "KeyPart":
        """This part read only by the call's queries `queries` (a `range`, module docstring)."""
        return self._replace(queries=queries)


def check_joined(joined, q: torch.Tensor, query_only: Optional[torch.Tensor], config, device,
                 score_mod=None) -> tuple:
    """Raise `ValueError` unless `joined` is a sequence of `KeyPart`s fit for a call with queries `q`
    (and `query_only`) on a cache of `config` on `device`, and the call has no `score_mod`; returns
    it as a tuple."""
    if score_mod is not None:
        raise ValueError("attend: joined keys take no score_mod (a joined key has no position in this cache's "
                         "stream); attend without score_mod, or merge a separate call by its log-sum-exp "
                         "(flexkv.cache.paths.merge.merge_attention)")
    N = q.shape[0]
    n_q = q.shape[2] + (0 if query_only is None else query_only.shape[2])
    if type(joined) is tuple and joined:
        H, D, Dv, dtype = config.num_heads, config.head_dim, config.value_head_dim, config.dtype
        for p in joined:  # every check below passes: one chain per part (a compiled step traces this per layer)
            if not (type(p) is KeyPart and type(p.k) is type(p.v) is torch.Tensor and p.k.dim() == 4
                    and p.k.shape == (N, H, p.k.shape[2], D) and p.v.shape == (N, H, p.k.shape[2], Dv)
                    and p.k.dtype == p.v.dtype == dtype and p.k.device == p.v.device == device
                    and (p.valid is None or (type(p.valid) is torch.Tensor and p.valid.dtype == torch.bool
                                             and p.valid.shape == (N, p.k.shape[2]) and p.valid.device == device))
                    and (p.queries is None or (type(p.queries) is range and p.queries.step == 1
                                               and 0 <= p.queries.start < p.queries.stop <= n_q))):
                break
        else:
            return joined
    if isinstance(joined, KeyPart) or not isinstance(joined, Sequence) or not joined:
        raise ValueError(f"attend_joined: parts must be a non-empty sequence of KeyPart, got {type(joined).__name__}; "
                         f"pass (part,) for one part")
    for i, p in enumerate(joined):
        if not isinstance(p, KeyPart):
            raise ValueError(f"attend_joined: parts[{i}] must be a KeyPart(k, v, valid=None, queries=None), "
                             f"got {type(p).__name__}")
        for name, t, width in (("k", p.k, config.head_dim), ("v", p.v, config.value_head_dim)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"attend_joined: parts[{i}].{name} must be a 4-D tensor [N, heads, K, dim], got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
            want = (N, config.num_heads, p.k.shape[2], width)
            if tuple(t.shape) != want:
                raise ValueError(f"attend_joined: parts[{i}].{name} shape expected {want} (rows, num_heads, the part's "
                                 f"keys, {'head_dim' if name == 'k' else 'value_head_dim'}), got {tuple(t.shape)}")
            if t.dtype != config.dtype or t.device != device:
                raise ValueError(f"attend_joined: parts[{i}].{name} must be {config.dtype} on {device} like the cache, "
                                 f"got {t.dtype} on {t.device}")
        if p.valid is not None and (not isinstance(p.valid, torch.Tensor) or p.valid.dtype != torch.bool
                                    or tuple(p.valid.shape) != (N, p.k.shape[2]) or p.valid.device != device):
            raise ValueError(f"attend_joined: parts[{i}].valid must be a bool tensor [N={N}, K={p.k.shape[2]}] on "
                             f"{device} (which keys of each row exist) or None, got "
                             f"{getattr(p.valid, 'dtype', type(p.valid).__name__)} "
                             f"{tuple(getattr(p.valid, 'shape', ()))}")
        r = p.queries
        if r is not None and (not isinstance(r, range) or r.step != 1 or r.start < 0 or r.stop > n_q
                              or r.start >= r.stop):
            raise ValueError(f"attend_joined: parts[{i}].queries must be a non-empty range(a, b) within the call's "
                             f"{n_q} queries (its own, then its query-only ones) or None (all), got {r!r}")
    return tuple(joined)


def _own_cells(store, plan, n_q: int) -> tuple:
    """`(cells [N, W], allowed [N, 1, 1 or T + n_q, W], live [N], all_read)` of `plan`'s rows (`W =
    max_retained + max_step_tokens`): the cells each row may read (its plan intervals side by side),
    whether the call's query (own queries, then `n_q` query-only ones at the newest own token) reads
    each (one row for every query when all read alike), which rows hold a request, and whether every
    row is known on the host to hold one and read some cell (else False)."""
    c, T = store.config, plan.tokens
    W = gather_width(c)
    N = plan.rows
    same = c.query_window is None and not c.causal_step  # every query of a row reads its intervals whole
    if same and not torch.compiler.is_compiling():
        # Eagerly, laid out from the plan's host table: a few small tensors instead of some twenty ops.
        cells, used, live = [], [], []
        for i in range(N):
            live.append(plan.field("sink_base", i) >= 0)
            row = [j for lo, hi in plan.cell_intervals(i) for j in range(lo, hi)] if live[-1] else []
            cells += row + [0] * (W - len(row))
            used += [True] * len(row) + [False] * (W - len(row))
        all_read = all(live) and all(used[i * W] for i in range(N))
        dev = store.device
        cells = torch.tensor(cells, dtype=torch.long).view(N, W).to(dev, non_blocking=True)
        flags = torch.tensor(used + live, dtype=torch.bool).to(dev, non_blocking=True)
        return cells, flags[:N * W].view(N, 1, 1, W), flags[N * W:], all_read
    dev = plan.write_index.device
    cells, used = interval_cells(plan, W, dev)
    if same:
        allowed = used.view(N, 1, 1, W)
    else:
        newest = newest_token(plan, c.reverse_step_order).long().view(N, 1)
        q_idx = torch.cat([torch.arange(T, device=dev).expand(N, T), newest.expand(N, n_q)], 1).view(N, 1, -1, 1)
        rows = torch.arange(N, device=dev).view(N, 1, 1, 1)
        allowed = store_mask_mod(store, plan, T, False)(rows, torch.zeros((), dtype=torch.long, device=dev), q_idx,
                                                 cells.view(N, 1, 1, W)) & used.view(N, 1, 1, W)
    return cells, allowed, plan.sink_base >= 0, False


def _geometry(store, plan, n_q: int, joined: tuple, dtype, eager: bool) -> tuple:
    """`(cells, bias [N, 1, T + n_q, W + sum K], reads [N, 1, T + n_q] or None)` of a joint call (`reads`
    None: every query is known to read some key); eagerly built once per plan and combination of
    parts (the parts' `valid` tensors by identity)."""
    key = ("joint", n_q, dtype, tuple((p.k.shape[2], p.queries, p.valid is None) for p in joined))
    valids = tuple(p.valid for p in joined)
    state = store.per_plan(plan) if eager else None
    if state is not None:
        found = state.get(key)
        if found is not None and all(a is b for a, b in zip(found[0], valids)):
            return found[1]
    cells, allowed, live, all_read = _own_cells(store, plan, n_q)
    N, W = cells.shape
    n_all = plan.tokens + n_q
    dev = cells.device
    # The parts' keys: which exist in each live row, and which queries read them (a host table).
    sizes = [p.k.shape[2] for p in joined]
    valid = torch.cat([p.valid if p.valid is not None else torch.ones(N, k, dtype=torch.bool, device=dev)
                       for p, k in zip(joined, sizes)], 1) & live.view(N, 1)
    shape = ("joint_readers", n_all, tuple((k, p.queries) for p, k in zip(joined, sizes)))
    # The same for every step of this shape: made once eagerly (a compiled graph makes it as a constant:
    # a memo it wrote would be a guard that fails at the next step).
    readers = store.memos.get(shape) if eager else None
    if readers is None:
        readers = torch.tensor(
            [p.queries is None or i in p.queries for i in range(n_all) for p, k in zip(joined, sizes) for _ in range(k)],
            dtype=torch.bool).view(1, 1, n_all, -1).to(dev)
        if eager:
            store.memos[shape] = readers
    every = torch.cat([allowed.expand(N, 1, n_all, W), valid.view(N, 1, 1, -1) & readers], -1)
    bias = every.to(dtype).log_()  # 0 where the query reads the key, -inf elsewhere
    geo = (cells, bias, None if all_read else every.any(-1))
    if state is not None:
        state[key] = (valids, geo)
    return geo


def _read_cells(kc, vc, scales, cells, dtype) -> tuple:
    """The gathered cells `[N, H, W, D]` of layer buffers `kc`, `vc` (dequantized into `dtype` when
    `scales` is given)."""
    N, W = cells.shape
    flat = cells.view(N * W)
    keys = kc[0].index_select(1, flat).view(kc.shape[1], N, W, kc.shape[3]).transpose(0, 1)
    values = vc[0].index_select(1, flat).view(vc.shape[1], N, W, vc.shape[3]).transpose(0, 1)
    if scales is not None:
        k_scale, v_scale = (batch_cells(s, 0, N, cells, 0, 0) for s in scales)
        keys = (keys.to(SCALE_DTYPE) * k_scale).to(dtype)
        values = (values.to(SCALE_DTYPE) * v_scale).to(dtype)
    return keys, values


def joint_attention(store, q: torch.Tensor, query_only: Optional[torch.Tensor], kc, vc, scales, plan,
                    joined: tuple, scale: float, want_lse: bool) -> tuple:
    """`(out [N, Hq, T + Q, Dv], lse [N, Hq, T + Q] or None)` of the call's queries `q` and `query_only`
    (unscaled; `scale` multiplies their scores) over the layer's cells `kc`, `vc` after the step's write and the `joined` parts, in
    one softmax (module docstring)."""
    N, Hq, T, D = q.shape
    n_q = 0 if query_only is None else query_only.shape[2]
    H = kc.shape[1]
    g = Hq // H
    eager = not torch.compiler.is_compiling()
    cells, bias, reads = _geometry(store, plan, n_q, joined, q.dtype, eager)
    n_all = T + n_q
    keys, values = _read_cells(kc, vc, scales, cells, q.dtype)
    keys = torch.cat([keys] + [p.k for p in joined], 2)
    values = torch.cat([values] + [p.v for p in joined], 2)
    qs = q if query_only is None else torch.cat([q, query_only], 2)
    if g > 1:
        # A GQA group folds into the query axis: query head h * g + i reads KV head h, at rows i * n_all + t.
        qs = qs.reshape(N, H, g * n_all, D)
        bias = bias.repeat(1, 1, g, 1)
        reads = None if reads is None else reads.repeat(1, 1, g)
    if want_lse:
        work = torch.promote_types(q.dtype, torch.float32)
        scores = torch.matmul(qs.to(work), keys.to(work).transpose(-1, -2)) * scale + bias.to(work)
        top = scores.amax(-1, keepdim=True)
        top = top if reads is None else torch.where(reads.unsqueeze(-1), top, 0.0)
        probs = torch.exp(scores - top)
        total = probs.sum(-1, keepdim=True)
        out = (torch.matmul(probs, values.to(work)) / total.clamp_min(1e-30)).to(q.dtype)
        lse = (torch.log(total) + top).squeeze(-1)
        lse = (lse if reads is None else torch.where(reads, lse, NEG_INF)).reshape(N, Hq, n_all)
    else:
        out, lse = F.scaled_dot_product_attention(qs, keys, values, attn_mask=bias, scale=scale), None
    if reads is not None:  # a query that reads nothing (a padding row) gives zeros
        out = torch.where(reads.unsqueeze(-1), out, 0.0)
    return (out if g == 1 else out.reshape(N, Hq, n_all, values.shape[-1])), lse


def cells_part(store, kc, vc, scales, plan) -> KeyPart:
    """The cells each row of `plan` reads at its newest own token, as a `KeyPart` (`write_part`): the
    gathered keys and values of layer buffers `kc`, `vc` and which of them the row reads (`valid`,
    made once per plan eagerly, so every layer's part shares it)."""
    state = None if torch.compiler.is_compiling() else store.per_plan(plan)
    found = None if state is None else state.get("part_cells")
    if found is None:
        cells, allowed, live, _ = _own_cells(store, plan, 1)
        found = (cells, allowed.expand(-1, 1, plan.tokens + 1, -1)[:, 0, plan.tokens] & live.view(-1, 1))
        if state is not None:
            state["part_cells"] = found
    cells, valid = found
    keys, values = _read_cells(kc, vc, scales, cells, store.config.dtype)
    return KeyPart(keys, values, valid)


class JointPath:
    """The joint path of one store (`flexkv.cache.path_choice.AttentionPath`): no scratch, no plan parts; a
    call is `joint_attention` over its `PathCall` (`query_only` and `joined` set; the queries
    unscaled, the scale in `scale`); `part` is `write_part`'s `cells_part`."""

    name = "joint"

    def __init__(self, store):
        self.store = store

    def scratch(self, eager: bool, compiled: bool) -> dict:
        return {}

    def plan_parts(self, plan, eager: bool, compiled: bool) -> None:
        return None

    def __call__(self, call):
        return joint_attention(self.store, call.q, call.query_only, call.k_cells, call.v_cells, call.scales,
                               call.plan, call.joined, call.scale, call.lse)

    def part(self, kc, vc, scales, plan) -> KeyPart:
        return cells_part(self.store, kc, vc, scales, plan)
