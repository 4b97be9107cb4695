"""`UncachedHistory`: the same attention as a bounded cache, with nothing evicted.

A model streamed through a `BoundedKVManager` should compute exactly what
the same model computes when it keeps every key and value it ever produced
and recomputes attention over the whole history, masked by the retention
policy. `UncachedHistory` is that second model's storage: it has the
manager's host API (`add_source`, `admit`, `plan`, `commit`,
`reset_request`, `remove_request`) and an `attend` that takes the host step
instead of a plan, so a model can swap one for the other (see
`flexkv.wrap`).

It also applies rotary embeddings itself, from un-rotated keys, in either
position mode: ``"stream"`` rotates each entry at its stream index;
``"cache"`` rotates every attended key at its in-cache position and the
query at its own, at every step, the way StreamingLLM's reference code does.
It shares nothing with the cache's layout, planner or masks; the attended
sets and in-cache positions come from `flexkv.reference`. Computation is in
float64, dense, per query: a checking tool, not a fast path.
"""

from __future__ import annotations

from typing import Callable, Dict, Hashable, Optional

import torch

from .config import BoundedKVConfig
from .reference import ReferenceCache, attended_indices, cache_positions, own_stream_indices
from .step import BoundedKVStep

__all__ = ["UncachedHistory"]

_POSITION_MODES = ("stream", "cache")


class UncachedHistory:
    """Every key and value of every stream, for `config`'s model shape (float64, on the CPU).

    `attend(layer, q, k, v, step, ...)` mirrors `BoundedKVManager.attend`
    (`q [N, Hq, T, D]`, `k, v [N, H, T, D]`, returns `[N, Hq, T, D]` in
    `q`'s dtype and device) and adds `rotary`/`rope_positions`; `commit`
    appends each request's written tokens (in stream order) from the last
    `attend` of every layer.
    """

    def __init__(self, config: BoundedKVConfig):
        if not isinstance(config, BoundedKVConfig):
            raise ValueError(f"config must be a BoundedKVConfig, got {type(config).__name__}")
        self.config = config
        self._sources: Dict[int, tuple] = {}
        self._private: Dict[Hashable, tuple] = {}
        # Whole streams are kept (and committed in stream order) exactly as the reference keeps them.
        self._history = ReferenceCache(config)

    # ---------------------------------------------------------------- host API

    def _check_source(self, what: str, keys: torch.Tensor, values: torch.Tensor) -> tuple:
        c = self.config
        want = (c.num_layers, c.rows_per_request, c.num_heads)
        if keys.dim() != 5 or tuple(keys.shape[:3]) != want or keys.shape != values.shape:
            raise ValueError(
                f"{what}: keys and values must both be [{want[0]}, {want[1]}, {want[2]}, L, {c.head_dim}], "
                f"got {tuple(keys.shape)} and {tuple(values.shape)}"
            )
        return keys.detach().double().cpu(), values.detach().double().cpu()

    def add_source(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Register a source `[num_layers, rows_per_request, num_heads, L, head_dim]` (un-rotated keys)."""
        entry = self._check_source("add_source", keys, values)
        index = next(i for i in range(len(self._sources) + 1) if i not in self._sources)
        self._sources[index] = entry
        return index

    def remove_source(self, index: int) -> None:
        self._sources.pop(index)

    def add_private_source(self, request_id: Hashable, keys: torch.Tensor, values: torch.Tensor) -> int:
        """A prefix of `request_id`'s own, read when its position declares `source=-1`."""
        self._private[request_id] = self._check_source("add_private_source", keys, values)
        return -1

    def admit(self, step: BoundedKVStep) -> None:
        """Check that each request's `written` matches what was committed."""
        for seg in step.segments:
            if seg.request_id is None:
                continue
            pos = step.positions[seg.request_id]
            have = self.written(seg.request_id)
            if pos.written != have:
                raise ValueError(f"request {seg.request_id!r}: written={pos.written} but {have} are committed")

    def plan(self, step: BoundedKVStep) -> None:
        """Nothing to plan: `attend` reads the host step."""
        return None

    def written(self, request_id: Hashable) -> int:
        layers = self._history.streams.get(request_id)
        return 0 if layers is None else layers[0][0].shape[2]

    def commit(self, step: BoundedKVStep) -> None:
        """Append each request's written tokens, for every layer it attended, in stream order."""
        self._history.commit(step)

    def reset_request(self, request_id: Hashable) -> None:
        self._history.reset_request(request_id)

    def remove_request(self, request_id: Hashable) -> None:
        self._history.remove_request(request_id)

    # ---------------------------------------------------------------- attention

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
        rotary=None,
        rope_positions: str = "stream",
    ) -> torch.Tensor:
        """Attention of `step` for `layer` over the whole history, masked by retention (docs/contract.md section 2).

        `positions` chooses what `score_mod` receives, `rope_positions` where
        `rotary` (a `flexkv.rotary.Rotary`, or None) rotates queries and keys.
        """
        for name, mode in (("positions", positions), ("rope_positions", rope_positions)):
            if mode not in _POSITION_MODES:
                raise ValueError(f"attend: {name} must be one of {_POSITION_MODES}, got {mode!r}")
        c = self.config
        R = c.rows_per_request
        dtype, device = q.dtype, q.device
        q, k, v = (x.detach().double().cpu() for x in (q, k, v))
        N, Hq, T, D = q.shape
        group = Hq // c.num_heads
        scale = D ** -0.5 if scale is None else scale
        out = torch.zeros(N, Hq, T, D, dtype=torch.float64)
        heads = torch.arange(Hq)
        for si, seg in enumerate(step.segments):
            rid = seg.request_id
            if rid is None:
                continue
            pos = step.positions[rid]
            L, n = pos.source_len, pos.length
            own = own_stream_indices(n, seg.span, T, c.reverse_step_order)
            sets = attended_indices(c, L, pos.written, seg.span, T)
            rows = slice(si * R, si * R + R)
            self._history.pending[(rid, layer)] = (k[rows], v[rows], seg.span, own)
            K_hist, V_hist = self._history.stream(rid)[layer]
            order = sorted(range(T), key=lambda t: own[t])
            parts_k, parts_v = [], []
            if L:
                sk, sv = self._private[rid] if pos.source == -1 else self._sources[pos.source]
                parts_k.append(sk[layer, :, :, :L])
                parts_v.append(sv[layer, :, :, :L])
            parts_k += [K_hist[:, :, : pos.written], k[rows][:, :, order]]
            parts_v += [V_hist[:, :, : pos.written], v[rows][:, :, order]]
            K_all = torch.cat(parts_k, dim=2)  # [R, H, n + T, D]: index = stream index
            V_all = torch.cat(parts_v, dim=2)
            # Queries with the same attended set (all of them, with a per-step window) go together.
            groups = [list(range(T))] if c.query_window is None else [[t] for t in range(T)]
            for ts in groups:
                idx = sets[ts[0]]
                ranks, _ = cache_positions(idx, idx[0]) if idx else ([], 0)
                rank = dict(zip(idx, ranks))
                qranks = [rank[own[t]] for t in ts]
                idx_t = torch.tensor(idx, dtype=torch.long)
                kk = K_all[:, :, idx_t]  # [R, H, K, D]
                qq = q[rows][:, :, ts]  # [R, Hq, G, D]
                if rotary is not None:
                    cache_mode = rope_positions == "cache"
                    kk = rotary.rotate(kk, torch.tensor(ranks) if cache_mode else idx_t)
                    qq = rotary.rotate(qq, torch.tensor(qranks if cache_mode else [own[t] for t in ts]))
                kk = kk.repeat_interleave(group, 1)
                vv = V_all[:, :, idx_t].repeat_interleave(group, 1)
                scores = (qq @ kk.transpose(-1, -2)) * scale  # [R, Hq, G, K]
                if score_mod is not None:
                    stream_mode = positions == "stream"
                    kpos = (idx_t if stream_mode else torch.tensor(ranks, dtype=torch.long)).view(1, 1, -1)
                    qpos = torch.tensor([own[t] for t in ts] if stream_mode else qranks).view(1, -1, 1)
                    for r in range(R):
                        b = torch.tensor(si * R + r)
                        scores[r] = score_mod(scores[r], b, heads.view(Hq, 1, 1), qpos, kpos).double()
                out[rows][:, :, ts] = torch.softmax(scores, dim=-1) @ vv
        return out.to(dtype=dtype, device=device)
