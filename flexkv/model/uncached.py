"""`UncachedHistory`: the same attention as a bounded cache, with nothing evicted.

A model streamed through a bounded cache should compute exactly what the
same model computes when it keeps every key and value it ever produced and
recomputes attention over the whole history, masked by the retention
policy. `UncachedHistory` is that second model's storage. It meets the same
cache protocol (`flexkv.cache.protocol.StreamCache`) as `BoundedKVManager`,
in either retention form (one policy, or layer groups
with their own), so a model, a `StreamSession` or a `flexkv.model.wrap` port
swaps one for the other without a change.

Its host bookkeeping (which requests hold slots, which sources are
registered, what each request committed) is a bounded cache's own slot
table (`flexkv.cache.host.slots.SlotTable`), and its sources are checked by the
bounded cache's shape checks: it accepts and refuses exactly the
declarations, sources and slot counts the bounded cache does, with the same
messages. Its attention is the dense whole-stream reference's
(`flexkv.model.reference.ReferenceCache`, one per layer group, in float64),
which shares nothing with the cache's layout, planner or masks: a checking
tool, not a fast path.

Rotary embeddings are applied there, from un-rotated keys, in either
position mode: ``"stream"`` rotates each entry at its stream index;
``"cache"`` rotates every attended key at its in-cache position and the
query at its own, at every step, the way StreamingLLM's reference code does.

With quantized slots (`config.slot_dtype`), it keeps what the bounded cache
reads back for every key and value (`flexkv.cache.storage.quantized.round_trip`) and
attends over that: a quantized cache and its twin then agree as closely as
unquantized ones do. (Rotary embeddings applied here are refused with
quantized slots: the bounded cache quantizes rotated keys, which the twin,
rotating at every step, never holds.)
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..cache.attend_modes import Attended, AttendModes
from ..cache.groups import as_layer_groups, layer_group_configs
from ..cache.host.lifecycle import StoreHooks, StreamLifecycle
from ..cache.host.slots import SlotTable
from ..cache.host.sources import check_source_shapes, split_source
from ..cache.paths.joint_path import KeyPart, check_joined
from ..cache.positions.masks import POSITION_MODES
from ..cache.positions.rotary import ROPE_POSITIONS, Rotary, check_cache_config, check_cache_step
from ..cache.storage.quantized import round_trip
from ..config import BoundedKVConfig, check_config, check_layer_index
from ..step import BoundedKVStep
from .reference import ReferenceCache, own_stream_indices

__all__ = ["UncachedHistory", "UncachedPlan"]


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

    def __init__(self, history: "UncachedHistory", layer_idx: int, rotary: Rotary, mode: str,
                 rotated_inputs: bool = False):
        self.history, self.layer_idx, self.rotary, self.mode = history, layer_idx, rotary, mode
        self.rotated_inputs = rotated_inputs

    def check_step(self, step: BoundedKVStep) -> None:
        if self.mode == "cache":
            check_cache_step(self.history.layer_config(self.layer_idx), step)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, plan=None):
        if not self.rotated_inputs:
            return q, k
        # Rotated at stream positions by the model: turned back, as the twin keeps keys un-rotated.
        pos = self.history.stream_positions(plan, k.shape[2])
        return self.rotary.rotate(q, -pos), self.rotary.rotate(k, -pos)


class HistoryStore(StoreHooks):
    """One layer group's whole history (`ReferenceCache`) as a store of the lifecycle: it keeps every
    change the table makes, and has no slots to copy."""

    def __init__(self, ref: ReferenceCache):
        self.ref = ref
        self.config = ref.config

    def write_source(self, index: int, keys, values, length: int, request_id=None) -> None:
        if request_id is None:
            self.ref.add_source(index, keys, values)
        else:
            self.ref.add_private_source(request_id, keys, values)

    def on_commit(self, step) -> None:
        self.ref.commit(step)

    def on_reset(self, request_id) -> None:
        self.ref.reset_request(request_id)

    def on_remove(self, request_id) -> None:
        self.ref.remove_request(request_id)
        self.ref.remove_private_source(request_id)  # the table frees it with the request

    def on_fork(self, parent_id, child_id) -> None:
        self.ref.fork(parent_id, child_id)

    def on_reorder(self, mapping) -> None:
        self.ref.reorder(mapping)

    def on_rollback(self, request_id, written: int) -> None:
        self.ref.rollback(request_id, written)

    def on_remove_source(self, index: int) -> None:
        self.ref.remove_source(index)

    def on_remove_private(self, request_id) -> None:
        self.ref.remove_private_source(request_id)


class UncachedHistory(AttendModes, StreamLifecycle):
    """Every key and value of every stream, for `config`'s model shape (float64, on the CPU).

    Args:
        config: the model shape and retention, as for `BoundedKVManager`.
        groups: as for `BoundedKVManager` (LayerGroups, or one retention per
            layer): each layer group attends by its own retention.

    One slot table (`slots`) and one dense reference per layer group.
    `attend(layer_idx, q, k, v, plan, ...)` is `BoundedKVManager.attend`
    (`q [N, Hq, T, D]`, `k [N, H, T, D]`, `v [N, H, T, value_head_dim]`,
    returns `[N, Hq, T, value_head_dim]` in `q`'s dtype and device), rotating
    queries and keys as `rotation(layer_idx, ...)` recorded for the layer;
    `commit` appends each request's written tokens (in stream order) from the
    last `attend` of every layer.
    """

    #: Attention runs on the host in float64: not traceable by `torch.compile`.
    compilable = False

    def __init__(self, config: BoundedKVConfig, groups=None):
        check_config(config)
        if groups is not None:
            groups = as_layer_groups(config, groups)
        self.config = config
        host_config = config if config.dtype is not None else config.replace(dtype=torch.float64)
        self.groups, self._configs, self._route = layer_group_configs(host_config, groups)
        #: The bounded cache's own host bookkeeping and checks (`flexkv.cache.host.slots.SlotTable`).
        self.slots = SlotTable(host_config)
        self._lock = self.slots.lock
        # Every stream whole, per layer group: the dense reference of each group's retention keeps it,
        # and attends over it.
        self._history = tuple(ReferenceCache(c) for c in self._configs)
        self._stores = tuple(HistoryStore(ref) for ref in self._history)
        self._rotary: Dict[int, tuple] = {}

    # ------------------------------------------------------------- views

    def layer_config(self, layer_idx: int) -> BoundedKVConfig:
        """The config that governs layer `layer_idx` (its group's retention and windows)."""
        return self._configs[self._route[check_layer_index(layer_idx, self.config.num_layers)][0]]

    @property
    def memory_bytes(self) -> int:
        """Bytes of everything kept: sources and every stream's whole history (it grows)."""
        total = 0
        for ref in self._history:
            for kv in (*ref.sources.values(), *ref.private.values(), *(kv for s in ref.streams.values() for kv in s)):
                total += sum(t.numel() * t.element_size() for t in kv)
        return total

    # --------------------------------------------------------- lifecycle
    # `StreamLifecycle` (flexkv.cache.host.lifecycle) writes the members once, over the same table as the
    # bounded cache and one whole-history store per group: every call is refused exactly where the
    # bounded cache refuses it (the same table and each group's ring decide), though nothing here is
    # ever overwritten.

    def _source_shares(self, what: str, keys: torch.Tensor, values: torch.Tensor):
        """Each group's share of all-layer source tensors, checked as the bounded cache checks them
        (float64, CPU), and the source's length."""
        shares = split_source(what, self.config, self.groups, self._configs, keys, values)
        length = None
        for cfg, (k, v) in zip(self._configs, shares):
            length = check_source_shapes(cfg, what, k, v)
        # Quantized slots: what the bounded cache reads back for the source (itself when unquantized).
        return [(store, round_trip(k.detach(), cfg.slot_dtype).double().cpu(),
                 round_trip(v.detach(), cfg.slot_dtype).double().cpu())
                for store, cfg, (k, v) in zip(self._stores, self._configs, shares)], length

    def _plan_step(self, step, slots, private, eager_only) -> UncachedPlan:
        """The plan is the host step itself (read by eager calls only whether or not `eager_only` says so:
        this cache does not compile)."""
        return UncachedPlan(step, self.config)

    # ------------------------------------------------------- model side

    def stream_positions(self, plan, tokens: Optional[int] = None) -> torch.Tensor:
        """Stream index of each of the step's own tokens, `[N, T]` int64 (padding rows count from 0)."""
        if isinstance(plan, BoundedKVStep):
            plan = UncachedPlan(plan, self.config)
        if not isinstance(plan, UncachedPlan):
            raise ValueError(f"stream_positions needs this cache's plan (cache.plan(step)), got {type(plan).__name__}")
        return plan.stream_positions(tokens)

    def write_part(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, plan: UncachedPlan) -> KeyPart:
        """`BoundedKVManager.write_part` over the whole history: the step's keys recorded, and what each row's
        newest own token attends under the layer's retention, as a `KeyPart` in `k`'s dtype and device
        (padded to the largest row, `valid` marking each row's keys)."""
        step = plan.step if isinstance(plan, UncachedPlan) else plan
        if not isinstance(step, BoundedKVStep):
            raise ValueError(f"write_part needs this cache's plan: pass plan=cache.plan(step), got {type(plan).__name__}")
        if layer_idx in self._rotary:
            raise ValueError(f"write_part: layer {layer_idx} has a rotation (rotation()); write_part hands keys to "
                             f"another cache's softmax as stored, so rotate them in the model instead")
        g, local = self._route[check_layer_index(layer_idx, self.config.num_layers)]
        sd = self._configs[g].slot_dtype
        keys, values, valid = self._history[g].write_part(local, round_trip(k, sd), round_trip(v, sd), step)
        return KeyPart(keys.to(dtype=k.dtype, device=k.device), values.to(dtype=v.dtype, device=v.device),
                       valid.to(k.device))

    def rotation(self, layer_idx: int, rotary: Rotary, mode: str = "stream", *,
                 rotated_inputs: bool = False) -> _Rotation:
        """Rotary positions for layer `layer_idx`: applied by `attend` over the whole history (keys
        are kept un-rotated; with `rotated_inputs` the rotation turns the model's stream-rotated q and k
        back first), refusing what the bounded cache refuses in ``"cache"`` mode."""
        if not isinstance(rotary, Rotary):
            raise ValueError(f"rotation: rotary must be a flexkv.cache.positions.rotary.Rotary, got {type(rotary).__name__}")
        if mode not in ROPE_POSITIONS:
            raise ValueError(f"rotation: mode must be one of {ROPE_POSITIONS}, got {mode!r}")
        cfg = self.layer_config(layer_idx)
        if cfg.slot_dtype is not None:
            raise ValueError(
                f"rotation: UncachedHistory rotates un-rotated keys at every step, but a cache with quantized "
                f"slots (slot_dtype={cfg.slot_dtype}) stores rotated keys quantized, which the twin never holds; "
                f"rotate q and k in the model before attend (as transformers models do), or use slot_dtype=None"
            )
        if rotary.head_dim != cfg.head_dim:
            raise ValueError(f"rotation: rotary.head_dim={rotary.head_dim} differs from the cache's head_dim={cfg.head_dim}")
        if mode == "cache":
            check_cache_config(cfg)
        self._rotary[layer_idx] = (rotary, mode)
        return _Rotation(self, layer_idx, rotary, mode, rotated_inputs)

    def _attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: UncachedPlan,
        *,
        scale: Optional[float] = None,
        score_mod: Optional[Callable] = None,
        positions: str = "stream",
        sinks: Optional[torch.Tensor] = None,
        want_lse: bool = False,
        query_only: Optional[torch.Tensor] = None,
        joined: Optional[Sequence[KeyPart]] = None,
    ):
        """Attention of the planned step for `layer_idx` over the whole history, masked by the layer's
        retention (docs/contract.md section 2); the modes are `flexkv.cache.attend_modes`'s.

        `plan` is what `plan(step)` returned (a `BoundedKVStep` is taken too).
        `positions` chooses what `score_mod` receives; `sinks` are learned
        sink logits `[Hq]`, `want_lse`, `query_only` and `joined` as in `BoundedKVManager._attend`. Queries and
        keys are rotated as `rotation(layer_idx, rotary, mode)` recorded for the
        layer (not at all if it was never called).
        """
        step = plan.step if isinstance(plan, UncachedPlan) else plan
        if not isinstance(step, BoundedKVStep):
            raise ValueError(f"attend needs this cache's plan: pass plan=cache.plan(step), got {type(plan).__name__}")
        if positions not in POSITION_MODES:
            raise ValueError(f"attend: positions must be one of {POSITION_MODES}, got {positions!r}")
        rotary, rope_positions = self._rotary.get(layer_idx, (None, "stream"))
        g, local = self._route[check_layer_index(layer_idx, self.config.num_layers)]
        if joined is not None:
            joined = check_joined(joined, q, query_only, self._configs[g], q.device, score_mod)
        sd = self._configs[g].slot_dtype
        k, v = round_trip(k, sd), round_trip(v, sd)  # quantized slots: what the bounded cache reads back
        out = self._history[g].attend(local, q, k, v, step, scale=scale, score_mod=score_mod, positions=positions,
                                      sinks=sinks, rotary=rotary, rope_positions=rope_positions, return_lse=want_lse,
                                      query_only=query_only, joined=joined)
        if not want_lse:
            return out.to(dtype=q.dtype, device=q.device)
        if query_only is not None:  # the step's queries, then the query-only ones
            out = tuple(torch.cat([a, b], dim=2) for a, b in zip(*out))
        return Attended(out[0].to(dtype=q.dtype, device=q.device),
                        out[1].to(dtype=torch.promote_types(q.dtype, torch.float32), device=q.device))
