"""`UncachedHistory`: the same attention as a bounded cache, with nothing evicted.

A model streamed through a bounded cache should compute exactly what the
same model computes when it keeps every key and value it ever produced and
recomputes attention over the whole history, masked by the retention
policy. `UncachedHistory` is that second model's storage. It meets the same
cache protocol (`flexkv.cache.protocol.StreamCache`) as `BoundedKVManager` and
`GroupedKVManager`, in either retention form (one policy, or layer groups
with their own), so a model, a `StreamSession` or a `flexkv.model.wrap` port
swaps one for the other without a change.

Its host bookkeeping (which requests hold slots, which sources are
registered, what each request committed) is a bounded cache's own, built on
the `"meta"` device (which allocates nothing): it accepts and refuses
exactly the declarations, sources and slot counts the bounded cache does,
with the same messages. Its attention shares nothing with the cache's
layout, planner or masks: the attended sets and in-cache positions come
from `flexkv.model.reference`, computed in float64, dense, per query: a checking
tool, not a fast path.

Rotary embeddings are applied here, from un-rotated keys, in either
position mode: ``"stream"`` rotates each entry at its stream index;
``"cache"`` rotates every attended key at its in-cache position and the
query at its own, at every step, the way StreamingLLM's reference code does.
"""

from __future__ import annotations

from typing import Callable, Dict, Hashable, List, Optional

import torch

from ..config import BoundedKVConfig
from ..cache.groups import GroupedKVManager, layer_group_configs
from .reference import ReferenceCache, attended_indices, cache_positions, own_stream_indices
from ..cache.rotary import ROPE_POSITIONS, Rotary, check_cache_config, check_cache_step
from ..step import BoundedKVStep

__all__ = ["UncachedHistory", "UncachedPlan"]

_POSITION_MODES = ("stream", "cache")


class UncachedPlan:
    """What `UncachedHistory.plan` returns: the host step, and the stream index of each own token."""

    def __init__(self, step: BoundedKVStep, config: BoundedKVConfig):
        R = config.rows_per_request
        self.step = step
        self.rows = len(step.segments) * R
        self.tokens = step.step_tokens
        positions: List[List[int]] = []
        for seg in step.segments:
            if seg.request_id is None:
                own = list(range(self.tokens))
            else:
                own = own_stream_indices(step.positions[seg.request_id].length, seg.span, self.tokens,
                                         config.reverse_step_order)
            positions.extend([own] * R)
        self._positions = positions

    def stream_positions(self, tokens: Optional[int] = None) -> torch.Tensor:
        T = self.tokens if tokens is None else tokens
        return torch.tensor([row[:T] for row in self._positions], dtype=torch.long).view(self.rows, T)

    def __repr__(self):
        return f"UncachedPlan(rows={self.rows}, tokens={self.tokens})"


class _Rotation:
    """What `UncachedHistory.rotation` returns: the twin rotates inside `attend`, so `q` and `k`
    pass through unchanged here; the layer's rotary and mode are recorded for `attend`."""

    def __init__(self, history: "UncachedHistory", layer_idx: int, rotary: Rotary, mode: str):
        self.history, self.layer_idx, self.rotary, self.mode = history, layer_idx, rotary, mode

    def check_step(self, step: BoundedKVStep) -> None:
        if self.mode == "cache":
            check_cache_step(self.history.layer_config(self.layer_idx), step)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, plan=None):
        return q, k


class UncachedHistory:
    """Every key and value of every stream, for `config`'s model shape (float64, on the CPU).

    Args:
        config: the model shape and retention, as for `BoundedKVManager`.
        groups: as for `GroupedKVManager` (LayerGroups, or one retention per
            layer): each layer group attends by its own retention.

    `attend(layer, q, k, v, plan, ...)` mirrors `BoundedKVManager.attend`
    (`q [N, Hq, T, D]`, `k, v [N, H, T, D]`, returns `[N, Hq, T, D]` in
    `q`'s dtype and device) and adds `rotary`/`rope_positions`; `commit`
    appends each request's written tokens (in stream order) from the last
    `attend` of every layer.
    """

    #: Attention runs on the host in float64: not traceable by `torch.compile`.
    compilable = False

    def __init__(self, config: BoundedKVConfig, groups=None):
        if not isinstance(config, BoundedKVConfig):
            raise ValueError(f"config must be a BoundedKVConfig, got {type(config).__name__}")
        if groups is not None:
            from ..cache.groups import as_layer_groups

            groups = as_layer_groups(config, groups)
        self.config = config
        host_config = config if config.dtype is not None else config.replace(dtype=torch.float64)
        groups, self._configs, self._route = layer_group_configs(host_config, groups)
        self.groups = groups
        # The bounded cache's own host state and checks; "meta" allocates no memory for it.
        self._host = GroupedKVManager(host_config, groups, "meta")
        self._sources: Dict[int, tuple] = {}
        self._private: Dict[Hashable, tuple] = {}
        # Whole streams, per layer group, kept (and committed in stream order) as the reference keeps them.
        self._history = tuple(ReferenceCache(c) for c in self._configs)
        self._rotary: Dict[int, tuple] = {}

    # ------------------------------------------------------------- views

    def layer_config(self, layer_idx: int) -> BoundedKVConfig:
        """The config that governs layer `layer_idx` (its group's retention and windows)."""
        return self._configs[self._host.group_of(layer_idx)[0]]

    @property
    def requests(self) -> tuple:
        return self._host.requests

    @property
    def free_slots(self) -> int:
        return self._host.free_slots

    @property
    def sources(self) -> dict:
        return self._host.sources

    @property
    def private_sources(self) -> dict:
        return self._host.private_sources

    def written(self, request_id: Hashable) -> int:
        return self._host.written(request_id)

    @property
    def memory_bytes(self) -> int:
        """Bytes of everything kept: sources and every stream's whole history (it grows)."""
        total = sum(t.numel() * t.element_size() for kv in (*self._sources.values(), *self._private.values())
                    for t in kv)
        for ref in self._history:
            for layers in ref.streams.values():
                total += sum(t.numel() * t.element_size() for kv in layers for t in kv)
        return total

    # ---------------------------------------------------------- sources

    def _meta(self, t):
        """The host's view of a source tensor: the same shape, no data."""
        return t.detach().to(device="meta", dtype=self._host.config.dtype) if isinstance(t, torch.Tensor) else t

    def add_source(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """Register a source `[num_layers, rows_per_request, num_heads, L, head_dim]` (un-rotated keys)."""
        index = self._host.add_source(self._meta(keys), self._meta(values))
        self._sources[index] = (keys.detach().double().cpu(), values.detach().double().cpu())
        return index

    def remove_source(self, index: int) -> None:
        self._host.remove_source(index)
        del self._sources[index]

    def add_private_source(self, request_id: Hashable, keys: torch.Tensor, values: torch.Tensor) -> int:
        """A prefix of `request_id`'s own, read when its position declares `source=-1`."""
        index = self._host.add_private_source(request_id, self._meta(keys), self._meta(values))
        self._private[request_id] = (keys.detach().double().cpu(), values.detach().double().cpu())
        return index

    def remove_private_source(self, request_id: Hashable) -> None:
        self._host.remove_private_source(request_id)
        del self._private[request_id]

    # --------------------------------------------------------- lifecycle

    def check_start(self, request_id: Hashable, source: int = 0, source_len: int = 0, *,
                    restart: bool = False) -> None:
        """Raise what `admit` would raise for this declaration (see `BoundedKVManager.check_start`)."""
        self._host.check_start(request_id, source, source_len, restart=restart)

    def admit(self, step: BoundedKVStep) -> None:
        """Check every declaration and give new requests a slot, as the bounded cache does (atomic)."""
        self._host.admit(step)

    def plan(self, step: BoundedKVStep) -> UncachedPlan:
        """Check the step as the bounded cache's `plan` does; the plan is the host step itself."""
        self._host.plan(step)
        return UncachedPlan(step, self.config)

    def commit(self, step: BoundedKVStep) -> None:
        """Append each request's written tokens, for every layer it attended, in stream order."""
        self._host.commit(step)
        for ref in self._history:
            ref.commit(step)

    def reset_request(self, request_id: Hashable) -> None:
        self._host.reset_request(request_id)
        for ref in self._history:
            ref.reset_request(request_id)

    def remove_request(self, request_id: Hashable) -> None:
        self._host.remove_request(request_id)  # frees its private source too
        self._private.pop(request_id, None)
        for ref in self._history:
            ref.remove_request(request_id)

    # ------------------------------------------------------- model side

    def stream_positions(self, plan, tokens: Optional[int] = None) -> torch.Tensor:
        """Stream index of each of the step's own tokens, `[N, T]` int64 (padding rows count from 0)."""
        if isinstance(plan, BoundedKVStep):
            plan = UncachedPlan(plan, self.config)
        if not isinstance(plan, UncachedPlan):
            raise ValueError(f"stream_positions needs this cache's plan (cache.plan(step)), got {type(plan).__name__}")
        return plan.stream_positions(tokens)

    def rotation(self, layer_idx: int, rotary: Rotary, mode: str = "stream") -> _Rotation:
        """Rotary positions for layer `layer_idx`: applied by `attend` over the whole history (keys
        are kept un-rotated), refusing what the bounded cache refuses in ``"cache"`` mode."""
        if not isinstance(rotary, Rotary):
            raise ValueError(f"rotation: rotary must be a flexkv.cache.rotary.Rotary, got {type(rotary).__name__}")
        if mode not in ROPE_POSITIONS:
            raise ValueError(f"rotation: mode must be one of {ROPE_POSITIONS}, got {mode!r}")
        cfg = self.layer_config(layer_idx)
        if rotary.head_dim != cfg.head_dim:
            raise ValueError(f"rotation: rotary.head_dim={rotary.head_dim} differs from the cache's head_dim={cfg.head_dim}")
        if mode == "cache":
            check_cache_config(cfg)
        self._rotary[layer_idx] = (rotary, mode)
        return _Rotation(self, layer_idx, rotary, mode)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan=None,
        *,
        scale: Optional[float] = None,
        score_mod: Optional[Callable] = None,
        positions: str = "stream",
        sinks: Optional[torch.Tensor] = None,
        rotary: Optional[Rotary] = None,
        rope_positions: Optional[str] = None,
    ) -> torch.Tensor:
        """Attention of the planned step for `layer` over the whole history, masked by the layer's
        retention (docs/contract.md section 2).

        `plan` is what `plan(step)` returned (a `BoundedKVStep` is taken too).
        `positions` chooses what `score_mod` receives; `sinks` are learned
        sink logits `[Hq]` as in `BoundedKVManager.attend`. `rotary` and
        `rope_positions` rotate queries and keys (default: what
        `rotation(layer, ...)` recorded for the layer, if anything).
        """
        step = plan.step if isinstance(plan, UncachedPlan) else plan
        if not isinstance(step, BoundedKVStep):
            raise ValueError("attend needs the step's plan: pass plan=cache.plan(step)")
        if rotary is None and layer in self._rotary:
            rotary, recorded = self._rotary[layer]
            rope_positions = recorded if rope_positions is None else rope_positions
        rope_positions = "stream" if rope_positions is None else rope_positions
        for name, mode in (("positions", positions), ("rope_positions", rope_positions)):
            if mode not in _POSITION_MODES:
                raise ValueError(f"attend: {name} must be one of {_POSITION_MODES}, got {mode!r}")
        g, local = self._host.group_of(layer)
        c = self._configs[g]
        history = self._history[g]
        R = c.rows_per_request
        dtype, device = q.dtype, q.device
        q, k, v = (x.detach().double().cpu() for x in (q, k, v))
        N, Hq, T, D = q.shape
        group = Hq // c.num_heads
        scale = D ** -0.5 if scale is None else scale
        sink_logits = None if sinks is None else sinks.detach().double().cpu()
        out = torch.zeros(N, Hq, T, v.shape[-1], dtype=torch.float64)
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
            history.pending[(rid, local)] = (k[rows], v[rows], seg.span, own)
            K_hist, V_hist = history.stream(rid)[local]
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
            # Queries with the same attended set go together: all of them for a per-step window.
            by_set: Dict[tuple, list] = {}
            for t in range(T):
                by_set.setdefault(tuple(sets[t]), []).append(t)
            for idx, ts in by_set.items():
                idx = list(idx)
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
                if sink_logits is not None:
                    # A learned sink joins the softmax as one more score with a zero value.
                    extra = sink_logits.view(1, Hq, 1, 1).expand(R, Hq, len(ts), 1)
                    probs = torch.softmax(torch.cat([scores, extra], dim=-1), dim=-1)[..., :-1]
                else:
                    probs = torch.softmax(scores, dim=-1)
                out[rows][:, :, ts] = probs @ vv
        return out.to(dtype=dtype, device=device)
