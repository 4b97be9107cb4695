"""A dense whole-stream reference for docs/contract.md section 2, in float64.

It keeps every entry of every stream (nothing is ever evicted), builds each
query's attended set straight from the definition, and computes softmax
attention over exactly that set. It shares no code with the cache's layout,
planner or masks, so agreement between the two is evidence, not tautology.
Slow by design: use it in tests and spot checks.
"""

from __future__ import annotations

from typing import Callable, Dict, Hashable, List, Optional

import torch

from ..config import BoundedKVConfig
from ..step import BoundedKVStep

__all__ = ["attended_indices", "own_stream_indices", "memory_reach", "ReferenceCache"]


def own_stream_indices(n: int, span: int, tokens: int, reverse: bool) -> List[int]:
    """Stream index of each of a step's `tokens` own tokens (contract section 2)."""
    return [n + span - 1 - t if (reverse and t < span) else n + t for t in range(tokens)]


def attended_indices(config: BoundedKVConfig, source_len: int, written: int, span: int, tokens: int) -> List[List[int]]:
    """For each query `t` of a step, the sorted stream indices it attends."""
    pol = config.retention_for(source_len)
    n = source_len + written
    s = pol.sink
    qw = config.query_window
    if qw is None:
        w = pol.window - span if pol.window_includes_step else pol.window
        keep = [j for j in range(n) if j < s or (w > 0 and j >= n - w)]
        if config.causal_step:  # the shared window, then the step's own tokens up to the query
            return [keep + list(range(n, n + t + 1)) for t in range(tokens)]
        row = keep + list(range(n, n + tokens))
        return [row for _ in range(tokens)]
    out = []
    for t in range(tokens):
        p = n + t
        out.append([j for j in range(p + 1) if j >= p - qw or j < s])
    return out


def memory_reach(config: BoundedKVConfig, n: int, span: int, t: int) -> tuple:
    """Under a `Recall` retention, what query `t` of a step at stream length `n` may read past its window:
    `(blocks, tail)`, the memory blocks (a `range` of block numbers, each read when the step chooses it)
    and the tail entries (read always), from the `Recall` docstring's definition."""
    recall = config.recall
    s, bs = recall.sink, recall.block
    w = max(s, n + t - config.query_window) if config.query_window is not None else recall.window_start(n, span)
    whole = (w - s) // bs
    return range(max(0, whole - recall.memory_blocks), whole), list(range(s + whole * bs, w))


class ReferenceCache:
    """Mirror of `BoundedKVManager`'s step API that keeps whole streams in float64.

    `attend` returns float64 `[N, Hq, T, Dv]` (`Dv`: the config's
    `value_head_dim`); `commit` appends each request's written tokens (from
    the last `attend` of every layer) in stream order.
    """

    def __init__(self, config: BoundedKVConfig):
        self.config = config
        self.sources: Dict[int, tuple] = {}
        self.private: Dict[Hashable, tuple] = {}
        # rid -> per layer: (K, V) of shape [R, H, written, D]
        self.streams: Dict[Hashable, List[tuple]] = {}
        self.pending: Dict[tuple, tuple] = {}

    def add_source(self, index: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.sources[index] = (keys.double().cpu(), values.double().cpu())

    def remove_source(self, index: int) -> None:
        self.sources.pop(index, None)

    def add_private_source(self, rid, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Request `rid`'s own source, read when its position declares `source=-1`."""
        self.private[rid] = (keys.double().cpu(), values.double().cpu())

    def remove_private_source(self, rid) -> None:
        self.private.pop(rid, None)

    def stream(self, rid) -> List[tuple]:
        """Request `rid`'s written entries per layer: `(K, V)`, `[R, H, written, head_dim]` and
        `[R, H, written, value_head_dim]` (created empty)."""
        c = self.config
        if rid not in self.streams:
            keys = torch.zeros(c.rows_per_request, c.num_heads, 0, c.head_dim, dtype=torch.float64)
            values = torch.zeros(c.rows_per_request, c.num_heads, 0, c.value_head_dim, dtype=torch.float64)
            self.streams[rid] = [(keys, values) for _ in range(c.num_layers)]
        return self.streams[rid]

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        step: BoundedKVStep,
        *,
        scale: Optional[float] = None,
        score_mod: Optional[Callable] = None,
        positions: str = "stream",
        sinks: Optional[torch.Tensor] = None,
        rotary=None,
        rope_positions: str = "stream",
        return_lse: bool = False,
        query_only: Optional[torch.Tensor] = None,
        joined=None,
        stored: Optional[Callable] = None,
    ) -> torch.Tensor:
        """Attention of `step` for `layer` over each query's attended set (contract section 2).

        `score_mod(score, b, h, q_pos, kv_pos)` gets stream positions, or with
        `positions="cache"` in-cache positions (section 6). `sinks`: learned
        sink logits `[Hq]` (see `flexkv.cache.paths.sinks`): each query head's softmax
        also normalises over one extra score `sinks[h]` that carries no value.
        `rotary` (a `flexkv.cache.positions.rotary.Rotary`): the keys and values kept are
        un-rotated, and every query and attended key is rotated at its stream
        index, or with `rope_positions="cache"` at its in-cache position, at
        every step (StreamingLLM's definition). Queries whose attended sets are
        equal are computed together. `return_lse`: `(out, lse)`, each query's
        natural-log sum of exp of its scores (the sink logit included),
        `[N, Hq, T]` float64, -inf where a query reads nothing. `query_only`
        (`[N, Hq, Q, D]`): queries that attend each row's newest own token's set
        at its positions and write nothing; the call returns `(out, extra)`
        (each `(out, lse)` with `return_lse`). `joined`: `KeyPart`s (`flexkv.cache.paths.joint_path`) whose
        keys of a row that exist join the softmax of each query the part names (own queries
        `0 .. T - 1`, then query-only ones `T ..`), as plain scores (no position, rotation or
        `score_mod`); a padding row reads none. `stored` (with `rotary`): what a cell reads back for the
        vector written into it (quantized slots: `flexkv.cache.storage.quantized.round_trip`), applied to
        each value as given and to each key as a cache holds it, rotated at its stream index (a sink
        under in-cache positions: at its stream index plus the entries evicted before the window,
        which gives the distance its in-cache position gives), before the rotation is made in-cache.
        """
        c = self.config
        R = c.rows_per_request
        q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
        N, Hq, T, D = q.shape
        group = Hq // c.num_heads
        scale = D ** -0.5 if scale is None else scale
        heads = torch.arange(Hq).view(Hq, 1, 1)
        sink_logits = None if sinks is None else sinks.double().cpu().view(Hq, 1, 1)
        out = torch.zeros(N, Hq, T, v.shape[3], dtype=torch.float64)
        lse = torch.full((N, Hq, T), float("-inf"), dtype=torch.float64)
        q2 = None if query_only is None else query_only.double().cpu()
        Q2 = 0 if q2 is None else q2.shape[2]
        out2 = torch.zeros(N, Hq, Q2, v.shape[3], dtype=torch.float64)
        lse2 = torch.full((N, Hq, Q2), float("-inf"), dtype=torch.float64)
        for si, seg in enumerate(step.segments):
            rid = seg.request_id
            if rid is None:
                continue
            pos = step.positions[rid]
            L, n, span = pos.source_len, pos.source_len + pos.written, seg.span
            own = own_stream_indices(n, span, T, c.reverse_step_order)
            sets = attended_indices(c, L, pos.written, span, T)
            by_set: Dict[tuple, List[int]] = {}
            for t in range(T):
                by_set.setdefault(tuple(sets[t]), []).append(t)
            rows = slice(si * R, si * R + R)
            self.pending[(rid, layer)] = (k[rows], v[rows], span, own)
            order = sorted(range(T), key=lambda t: own[t])  # own tokens in stream order
            for r in range(R):
                b = si * R + r
                K_all, V_all = self._row_history(layer, rid, pos, r, k[b][:, order], v[b][:, order])
                # Each set of equal attended sets at once; then the query-only queries, at the
                # newest own token's set and positions.
                newest = max(range(span), key=lambda t: own[t]) if span else None
                jobs = [(idx, ts, q[b][:, ts], out[b], lse[b], ts, 0) for idx, ts in by_set.items()]
                if q2 is not None and newest is not None:
                    jobs.append((tuple(sets[newest]), [newest] * Q2, q2[b], out2[b], lse2[b], list(range(Q2)), T))
                for idx, ts, qq, dest, dest_lse, at, first in jobs:
                    extra = self._joined(joined, b, [first + a for a in at], group)
                    idx = list(idx)
                    rank = {j: i for i, j in enumerate(idx)}  # in-cache positions: ranks in the set
                    key_pos = torch.tensor(idx, dtype=torch.long)
                    query_pos = torch.tensor([own[t] for t in ts], dtype=torch.long)
                    cache_key_pos = torch.arange(len(idx), dtype=torch.long)
                    cache_query_pos = torch.tensor([rank[own[t]] for t in ts], dtype=torch.long)
                    kk = K_all[:, key_pos]  # [H, K, D]
                    vv = V_all[:, key_pos]
                    if rotary is not None:
                        in_cache = rope_positions == "cache"
                        if stored is None:
                            kk = rotary.rotate(kk.unsqueeze(0), cache_key_pos if in_cache else key_pos)[0]
                        else:
                            evicted = int((key_pos - cache_key_pos).max()) if in_cache and len(idx) else 0
                            held = cache_key_pos + evicted if in_cache else key_pos
                            kk = stored(rotary.rotate(kk.unsqueeze(0), held)[0])
                            if evicted:
                                kk = rotary.rotate(kk.unsqueeze(0), torch.full_like(held, -evicted))[0]
                            vv = stored(vv)
                        qq = rotary.rotate(qq.unsqueeze(0), cache_query_pos if in_cache else query_pos)[0]
                    kk = kk.repeat_interleave(group, 0)  # [Hq, K, D]
                    vv = vv.repeat_interleave(group, 0)
                    scores = torch.einsum("hgd,hkd->hgk", qq, kk) * scale
                    if score_mod is not None:
                        in_cache = positions == "cache"
                        qp = (cache_query_pos if in_cache else query_pos).view(1, -1, 1)
                        kp = (cache_key_pos if in_cache else key_pos).view(1, 1, -1)
                        scores = score_mod(scores, torch.tensor(b), heads, qp, kp).double()
                    if extra is not None:  # the joined keys: plain scores, -inf where a query reads none
                        ek, ev, reads = extra
                        scores = torch.cat([scores, (torch.einsum("hgd,hkd->hgk", qq, ek) * scale).masked_fill(
                            ~reads, float("-inf"))], dim=-1)
                        vv = torch.cat([vv, ev], dim=1)
                    if c.recall is not None:  # the memory part: each KV head's selected blocks
                        ms, mv = self._memory(c, K_all, V_all, q[b], own, span, ts, group, scale, rotary,
                                              rope_positions, score_mod, positions, b, cache_query_pos, query_pos,
                                              stored)
                        scores, vv = torch.cat([scores, ms], dim=-1), torch.cat([vv, mv], dim=1)
                    if sink_logits is not None:
                        scores = torch.cat([scores, sink_logits.expand(Hq, len(ts), 1)], dim=-1)
                    probs = torch.softmax(scores, dim=-1)[..., : vv.shape[1]]
                    dest[:, at] = probs @ vv
                    dest_lse[:, at] = torch.logsumexp(scores, dim=-1)
        own_out = (out, lse) if return_lse else out
        if q2 is None:
            return own_out
        return own_out, ((out2, lse2) if return_lse else out2)

    @staticmethod
    def _memory(c, K_all, V_all, q_row, own, span, ts, group, scale, rotary, rope_positions, score_mod, positions,
                b, cache_query_pos, query_pos, stored=None):
        """A `Recall` row's memory part for queries `ts` (which share their window start): `(scores [Hq,
        len(ts), E], values [Hq, E, Dv])` over its tail and the entries of the blocks some KV head chose,
        -inf where a query head's KV head did not choose the entry's block (the `Recall` docstring's rule)."""
        recall = c.recall
        s, bs = recall.sink, recall.block
        n = own[0] if own else 0

        def window_start(t: int) -> int:
            return max(s, n + t - c.query_window) if c.query_window is not None else recall.window_start(n, span)

        def memory_blocks(t: int) -> range:
            return memory_reach(c, n, span, t)[0]

        in_memory = rotary is not None and rope_positions == "cache"
        t_mem = window_start(0) - 1
        H = K_all.shape[0]
        Hq = H * group

        def turned(x: torch.Tensor, at) -> torch.Tensor:  # rotated at stream positions `at`
            if rotary is None:
                return x
            return rotary.rotate(x.unsqueeze(0), torch.as_tensor(at, dtype=torch.long))[0]

        def key_at(js) -> torch.Tensor:  # [H, len(js), D]: keys at the positions memory is read at
            if stored is None:
                return turned(K_all[:, js], [t_mem] * len(js) if in_memory else js)
            held = stored(turned(K_all[:, js], js))  # as a cell holds it: rotated at its stream index
            return turned(held, [t_mem - j for j in js]) if in_memory else held

        candidates = sorted(set().union(*(memory_blocks(t) for t in range(span))))
        qsum = sum(turned(q_row[:, t:t + 1], [n + t]) for t in range(span))  # [Hq, 1, D]
        chosen = []  # per KV head, the chosen blocks
        for h in range(H):
            scored = []
            for blk in candidates:
                mean = key_at(list(range(s + blk * bs, s + (blk + 1) * bs)))[h].mean(dim=0)
                score = float(sum((qsum[h * group + i, 0] * mean).sum() for i in range(group)))
                scored.append((-score, blk))
            chosen.append({blk for _, blk in sorted(scored)[: recall.top_k]})
        t0 = ts[0]
        mine, tail = memory_reach(c, n, span, t0)
        picked = sorted({s + blk * bs + e for ch in chosen for blk in ch if blk in mine for e in range(bs)})
        entries = picked + tail
        qq = torch.cat([turned(q_row[:, t:t + 1], [n + t]) for t in ts], dim=1)  # [Hq, len(ts), D]
        kk = key_at(entries).repeat_interleave(group, 0)
        scores = torch.einsum("hgd,hkd->hgk", qq, kk) * scale
        if score_mod is not None:
            if positions == "cache":
                qp = cache_query_pos.view(1, -1, 1)
                kv = [t_mem if in_memory else j for j in entries]
                kp = qp - query_pos.view(1, -1, 1) + torch.tensor(kv, dtype=torch.long).view(1, 1, -1)
            else:
                qp = query_pos.view(1, -1, 1)
                kp = torch.tensor(entries, dtype=torch.long).view(1, 1, -1)
            heads = torch.arange(Hq).view(Hq, 1, 1)
            scores = score_mod(scores, torch.tensor(b), heads, qp, kp).double()
        allowed = torch.tensor([[j in tail or (j - s) // bs in chosen[h // group] for j in entries]
                                for h in range(Hq)], dtype=torch.bool).view(Hq, 1, len(entries))
        scores = scores.masked_fill(~allowed, float("-inf"))
        values = V_all[:, entries] if stored is None else stored(V_all[:, entries])
        return scores, values.repeat_interleave(group, 0)

    def _row_history(self, layer: int, rid, pos, r: int, k_own: torch.Tensor, v_own: torch.Tensor) -> tuple:
        """Row `r` of request `rid`'s whole history in `layer` with the step's own keys `k_own` (stream order)
        after it: `([H, n + T, D], [H, n + T, Dv])`, indexed by stream index."""
        L = pos.source_len
        Kw, Vw = self.stream(rid)[layer]
        parts_k, parts_v = [], []
        if L:
            sk, sv = self.private[rid] if pos.source == -1 else self.sources[pos.source]
            parts_k.append(sk[layer, r, :, :L])
            parts_v.append(sv[layer, r, :, :L])
        parts_k += [Kw[r, :, : pos.written], k_own]
        parts_v += [Vw[r, :, : pos.written], v_own]
        return torch.cat(parts_k, dim=1), torch.cat(parts_v, dim=1)

    def write_part(self, layer: int, k: torch.Tensor, v: torch.Tensor, step: BoundedKVStep) -> tuple:
        """Record the step's own keys of `layer` (as `attend` does) and return what each row's newest own
        token attends: `(keys [N, H, W, D], values [N, H, W, Dv], valid [N, W])` in float64, `W` the
        largest such set, `valid` marking each row's (a padding row: none)."""
        c = self.config
        R = c.rows_per_request
        k, v = k.double().cpu(), v.double().cpu()
        N, H, T, _ = k.shape
        rows = []
        for si, seg in enumerate(step.segments):
            rid = seg.request_id
            if rid is None:
                rows += [None] * R
                continue
            pos = step.positions[rid]
            n, span = pos.source_len + pos.written, seg.span
            own = own_stream_indices(n, span, T, c.reverse_step_order)
            self.pending[(rid, layer)] = (k[si * R:si * R + R], v[si * R:si * R + R], span, own)
            order = sorted(range(T), key=lambda t: own[t])
            newest = max(range(span), key=lambda t: own[t]) if span else 0
            idx = attended_indices(c, pos.source_len, pos.written, span, T)[newest]
            for r in range(R):
                K_all, V_all = self._row_history(layer, rid, pos, r, k[si * R + r][:, order], v[si * R + r][:, order])
                rows.append((K_all[:, idx], V_all[:, idx]))
        W = max([0] + [x[0].shape[1] for x in rows if x is not None])
        keys = torch.zeros(N, H, W, c.head_dim, dtype=torch.float64)
        values = torch.zeros(N, H, W, c.value_head_dim, dtype=torch.float64)
        valid = torch.zeros(N, W, dtype=torch.bool)
        for b, x in enumerate(rows):
            if x is not None:
                w = x[0].shape[1]
                keys[b, :, :w], values[b, :, :w], valid[b, :w] = x[0], x[1], True
        return keys, values, valid

    @staticmethod
    def _joined(joined, b: int, calls: List[int], group: int):
        """Row `b`'s joined keys for the queries `calls` (their indices in the call): `([Hq, E, D] keys,
        [Hq, E, Dv] values, [1, len(calls), E] which query reads which key)` in float64, or None."""
        if not joined:
            return None
        keys, values, reads = [], [], []
        for p in joined:
            have = torch.ones(p.k.shape[2], dtype=torch.bool) if p.valid is None else p.valid[b].cpu()
            keys.append(p.k[b].double().cpu()[:, have])
            values.append(p.v[b].double().cpu()[:, have])
            n = int(have.sum())
            reads.append(torch.tensor([[p.queries is None or c in p.queries] * n for c in calls],
                                      dtype=torch.bool).view(len(calls), n))
        return (torch.cat(keys, 1).repeat_interleave(group, 0), torch.cat(values, 1).repeat_interleave(group, 0),
                torch.cat(reads, 1).unsqueeze(0))

    def commit(self, step: BoundedKVStep) -> None:
        """Append each request's written tokens, for every layer it attended, in stream order."""
        for seg in step.segments:
            rid = seg.request_id
            if rid is None:
                continue
            layers = self.stream(rid)
            for layer in range(self.config.num_layers):
                got = self.pending.pop((rid, layer), None)
                if got is None:
                    continue
                k, v, span, own = got
                order = sorted(range(span), key=lambda t: own[t])
                Kw, Vw = layers[layer]
                pos = step.positions[rid]
                Kw, Vw = Kw[:, :, : pos.written], Vw[:, :, : pos.written]
                layers[layer] = (torch.cat([Kw, k[:, :, order]], dim=2), torch.cat([Vw, v[:, :, order]], dim=2))

    def reset_request(self, rid) -> None:
        self.streams.pop(rid, None)

    def fork(self, parent, child) -> None:
        """Request `child`'s stream becomes a copy of `parent`'s (written entries; its source is
        declared by its positions, as for any request)."""
        self.streams[child] = list(self.stream(parent))

    def reorder(self, mapping) -> None:
        """Each destination's stream becomes its source's, as it was before the call."""
        before = {dst: list(self.stream(src)) for dst, src in dict(mapping).items()}
        self.streams.update(before)

    def rollback(self, rid, written: int) -> None:
        """Keep the first `written` written entries of `rid`'s stream."""
        self.streams[rid] = [(k[:, :, :written], v[:, :, :written]) for k, v in self.stream(rid)]

    def remove_request(self, rid) -> None:
        self.streams.pop(rid, None)

    def load_stream(self, rid, keys: List[torch.Tensor], values: List[torch.Tensor]) -> None:
        """Give request `rid` an already-written stream, replacing what it had.

        `keys[layer]`: `[rows_per_request, num_heads, written, head_dim]`, `values[layer]` the
        same with `value_head_dim`: the request's written tokens in stream order. A long run can then be
        checked at a chosen step without replaying every step before it
        through `attend` (which would cost a whole-stream attention per step).
        """
        c = self.config
        if len(keys) != c.num_layers or len(values) != c.num_layers:
            raise ValueError(
                f"load_stream: expected {c.num_layers} layers of keys and values, got {len(keys)} and {len(values)}"
            )
        layers = []
        for layer, (k, v) in enumerate(zip(keys, values)):
            want = (c.rows_per_request, c.num_heads, k.shape[2] if k.dim() == 4 else -1, c.head_dim)
            want_v = want[:3] + (c.value_head_dim,)
            if k.dim() != 4 or tuple(k.shape) != want or tuple(v.shape) != want_v:
                raise ValueError(
                    f"load_stream: layer {layer} keys/values must be [rows_per_request={c.rows_per_request}, "
                    f"num_heads={c.num_heads}, written, head_dim={c.head_dim} / value_head_dim={c.value_head_dim}], "
                    f"got {tuple(k.shape)} and {tuple(v.shape)}"
                )
            layers.append((k.double().cpu(), v.double().cpu()))
        self.streams[rid] = layers
