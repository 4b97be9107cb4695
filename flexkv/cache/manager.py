"""`BoundedKVManager`: the bounded cache: one slot table, the lifecycle, and a `CacheGroup` per layer group.

Host state (which request holds which slot, what each has committed) lives
in one `flexkv.cache.host.slots.SlotTable`, plain Python objects behind its
lock. Device state lives in one `flexkv.cache.cache_group.CacheGroup` per
layer group (`flexkv.cache.groups.LayerGroup`: layers that keep the same
part of every stream): the group's layout, its store (one key and one value
tensor per layer, registered buffers allocated once) and its attention
paths. A model whose every layer keeps the same sink + window has one group;
Gemma 3's five sliding layers to one global layer, or gpt-oss's alternation,
have two, each with its own retention and so its own slot size.

A step goes `admit -> plan -> attend (per layer) -> commit`:

* `admit(step)` checks and admits the step once, in the table;
* `plan(step)` reads the table once and plans the step for each group (host
  ints): one group's `BoundedPlan`, or a `flexkv.cache.groups.GroupedPlan`
  of one plan per group;
* `attend(layer, ...)` runs the layer's attention in its group, with the
  group's plan and the layer's index inside the group;
* `commit(step)` records the written tokens once, in the table.

The lifecycle members (admit checks, plan, commit, reset, remove, sources,
fork, reorder, rollback) are `flexkv.cache.host.lifecycle.StreamLifecycle`'s,
written once for every cache, over the one table and every group's store. A
tensor-parallel rank (`flexkv.serving.distributed.ShardedKVManager`) is this
class with its groups holding the rank's heads.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..config import BoundedKVConfig, check_config, check_layer_index, resolve_device
from .attend_modes import AttendModes
from .cache_group import CacheGroup, StoreBuffers
from .groups import GroupRouting, OneGroup, as_layer_groups, layer_group_configs
from .host.lifecycle import StreamLifecycle
from .host.slots import SlotsExhausted, SlotTable, SourcesExhausted
from .paths.attention_options import AttentionOptions
from .paths.joint_path import KeyPart
from .storage import slot_copy
from .storage.store import LayerStore

__all__ = ["BoundedKVManager", "SlotsExhausted", "SourcesExhausted"]


class _MovedToOptions:
    """A former attention knob of the manager: settable no more (the options are fixed at build)."""

    def __set_name__(self, owner, name):
        self.name = name
        self.field = "path" if name == "attention_path" else name

    def _moved(self):
        return AttributeError(
            f"BoundedKVManager.{self.name} is fixed when the cache is built: pass "
            f"options=AttentionOptions.for_cache(config, device, {self.field}=...) to BoundedKVManager "
            f"and read it as manager.options.{self.field}")

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        raise self._moved()

    def __set__(self, obj, value):
        raise self._moved()


class BoundedKVManager(AttendModes, StreamLifecycle, StoreBuffers, nn.Module):
    """A bounded sink + window KV cache for `config.max_slots` requests (docs/contract.md section 5).

    Args:
        config: the cache's `BoundedKVConfig`: what every layer shares (heads, head dim, rows per
            request, slots, sources, dtype, `max_step_tokens`) and, without `groups`, the one
            retention and query window of every layer. Its `dtype` must be settled (build through
            `BoundedKVResource` to take the engine's).
        device: where the KV tensors live. `"meta"` allocates nothing and
            still plans, exactly as CUDA would (block size and full blocks), which
            shows that planning never touches device data.
        groups: layers grouped by what they keep: `flexkv.cache.groups.LayerGroup`s covering
            `range(config.num_layers)` once, or one retention per layer (`SinkWindow`s or callables;
            `flexkv.cache.groups.per_layer_groups` groups equal ones); each group replaces the
            config's retention and query window (and head sizes it sets) for its layers. None (the
            default): one group of every layer with the config's own.
        block_size: FlexAttention's KV block size (cells per block); None (the default) lets
            flexkv choose for each group's config and the device (`flexkv.cache.host.layout.default_block_size`).
        options: how attention is computed (`flexkv.cache.paths.attention_options.AttentionOptions`:
            path, GQA packing, full blocks, epilogue barrier, kernel sharing), fixed for the cache's
            life and the same for every group; None (the default) takes
            `AttentionOptions.for_cache(config, device)`.
        store: builds each group's device store, `store(config, device, layout)` returning a
            `flexkv.cache.storage.store.LayerStore` of the group's config; None (the default) builds
            a `LayerStore`. A factory that keeps part of each group's heads also has
            `group_config(config)` (the group's config as kept: the cache's `config` and every
            group's then read so) and `check_heads(group, q, k, v)` (run before each `attend`):
            tensor parallelism is such a factory (`flexkv.serving.distributed.ShardStores`).

    `cache_groups[g]` is group `g`'s `flexkv.cache.cache_group.CacheGroup` (its layer `i` is model
    layer `groups[g].layers[i]`). A one-group cache's `store`, `layout`, `paths` and `options` are its
    group's, and its buffers (`k_cache_{i}`, `v_cache_{i}`) read as the cache's own attributes.
    """

    def __init__(self, config: BoundedKVConfig, device="cpu", *, groups=None, block_size: Optional[int] = None,
                 options: Optional[AttentionOptions] = None, store: Optional[Callable[..., LayerStore]] = None):
        super().__init__()
        check_config(config)
        if config.dtype is None:
            raise ValueError(
                "config.dtype is None: the KV dtype is settled by the engine; build the cache with "
                "BoundedKVResource().build(spec, EngineResourceInfo(device, kv_dtype)) or set config.dtype"
            )
        self.config = config
        self.device = resolve_device(device)
        if options is None:
            options = AttentionOptions.for_cache(config, self.device)
        elif not isinstance(options, AttentionOptions):
            raise ValueError(
                f"options must be a flexkv.cache.paths.attention_options.AttentionOptions or None, got "
                f"{type(options).__name__}; build one with AttentionOptions.for_cache(config, device, ...)")
        if store is not None and not callable(store):
            raise ValueError(f"store must be a callable (config, device, layout) -> LayerStore, or None, got {store!r}")
        layer_groups, configs, route = layer_group_configs(
            config, None if groups is None else as_layer_groups(config, groups))
        share = getattr(store, "group_config", None)  # a store factory keeping part of each group's heads
        if share is not None:  # (a tensor-parallel rank's, `flexkv.serving.distributed.ShardStores`)
            configs = tuple(share(c) for c in configs)
            self.config = share(config)
        #: A check of `attend`'s heads before the group's own, `check(group, q, k, v)` (the store factory's).
        self._check_heads = getattr(store, "check_heads", None)
        #: The `LayerGroup`s: which layers keep which part of every stream.
        self.groups = layer_groups
        #: Host bookkeeping: slots, requests, source places (`flexkv.cache.host.slots`), under its lock.
        self.slots = SlotTable(config)
        self._lock = self.slots.lock
        built = [CacheGroup(c, self.device, options, block_size=block_size, store=store) for c in configs]
        #: One `CacheGroup` per layer group: its config, layout, store and attention paths.
        self.cache_groups = nn.ModuleList(built)
        # Host-side access without nn.ModuleList's indexing cost (it runs on every step and layer).
        self._groups = tuple(built)
        self._route = route
        self._stores = tuple(g.store for g in built)
        #: How a call reaches its group, chosen once (`flexkv.cache.groups`): one group's plans are its
        #: `BoundedPlan`s; several groups' are `GroupedPlan`s.
        self._routing = (OneGroup if len(built) == 1 else GroupRouting)(built, route)
        object.__setattr__(self, "_store", built[0].store if len(built) == 1 else None)

    # Former knobs, now `options` fields: setting one raises and says how to pass it.
    pack_gqa = _MovedToOptions()
    epilogue_barrier = _MovedToOptions()
    full_blocks = _MovedToOptions()
    attention_path = _MovedToOptions()
    share_flex_kernel = _MovedToOptions()

    # ------------------------------------------------------------------ views

    def _only_group(self, what: str) -> CacheGroup:
        """The one group of a one-group cache; with several, a `ValueError` saying where `what` lives."""
        return self._routing.only(what)

    @property
    def store(self) -> LayerStore:
        """A one-group cache's device store (`flexkv.cache.storage.store.LayerStore`)."""
        return self._only_group("store").store

    @property
    def layout(self):
        """A one-group cache's layout (`flexkv.cache.host.layout.Layout`)."""
        return self._only_group("layout").layout

    @property
    def paths(self):
        """A one-group cache's attention paths (`flexkv.cache.path_choice.AttentionPaths`)."""
        return self._only_group("paths").paths

    @property
    def options(self) -> AttentionOptions:
        """How this cache computes attention (`AttentionOptions`), fixed when it was built (every group's)."""
        return self._groups[0].options

    def group_of(self, layer_idx: int) -> tuple:
        """`(group, index inside the group)` of model layer `layer_idx`."""
        return self._route[check_layer_index(layer_idx, len(self._route))]

    def group_plan(self, layer_idx: int, plan):
        """The plan model layer `layer_idx`'s group reads, from this cache's `plan` (its `BoundedPlan`)."""
        return self._routing.layer_plan(layer_idx, plan)

    @property
    def memory_bytes(self) -> int:
        """Bytes every group's key and value tensors hold, and the scratch their attention paths
        allocated (`CacheGroup.memory_bytes`)."""
        return sum(g.memory_bytes for g in self._groups)

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot holds over every group, layer, row, keys and values (and their scales when
        quantized): the memory of one request."""
        return sum(g.slot_bytes for g in self._groups)

    def memory_report(self) -> tuple:
        """One dict per group: its name, layers, retention, query window, KV heads, key and value
        widths, slot dtype (None: unquantized), cells per slot row, bytes per slot (over its layers,
        keys and values, scales included) and bytes held."""
        return tuple(
            dict(name=lg.name, layers=lg.layers, retention=lg.retention, query_window=lg.query_window,
                 num_heads=g.config.num_heads, head_dim=g.config.head_dim, value_head_dim=g.config.value_head_dim,
                 causal_step=lg.causal_step, slot_dtype=g.config.slot_dtype, slot_cells=g.layout.slot_row_len,
                 slot_bytes=g.slot_bytes, memory_bytes=g.memory_bytes)
            for lg, g in zip(self.groups, self._groups))

    # ------------------------------------------------------ the cache protocol
    # What every flexkv cache offers the front doors above it (`flexkv.cache.protocol.StreamCache`).

    #: `attend` traces under `torch.compile(fullgraph=True)`.
    compilable = True

    def layer_config(self, layer_idx: int) -> BoundedKVConfig:
        """The config that governs model layer `layer_idx`: its group's (retention, windows, head sizes)."""
        return self._groups[self.group_of(layer_idx)[0]].config

    def rotation(self, layer_idx: int, rotary, mode: str = "stream", *, rotated_inputs: bool = False):
        """Rotary positions for model layer `layer_idx` (`flexkv.cache.positions.rotary.SinkRotation`, in its
        group): call it as `q, k = rotation(q, k, plan)` before `attend`; in ``"cache"`` mode run its
        `check_step` on the host before planning (`flexkv.model.step_context.StepContext` does)."""
        g, i = self.group_of(layer_idx)
        rotation = self._groups[g].rotation(i, rotary, mode, rotated_inputs=rotated_inputs)
        return self._routing.rotation(g, rotation)

    def stream_positions(self, plan, tokens: Optional[int] = None) -> torch.Tensor:
        """Stream index of each of the step's own tokens, `[N, T]` int64 on the device (contract
        section 2; the same in every group; padding rows count from 0). Traceable: no host sync."""
        return self._groups[0].stream_positions(self._routing.first_plan(plan), tokens)

    # -------------------------------------------------------------- lifecycle
    # `StreamLifecycle` (flexkv.cache.host.lifecycle) writes the members once, over the one table and
    # every group's store: the table changes once, each store copies its own slots, each group's ring
    # and retention decide what can be taken back.

    def _plan_step(self, step, slots, private, eager_only):
        """One plan per group, from one read of the table."""
        plans = [g.plan_from(step, slots, private, eager_only) for g in self._groups]
        return self._routing.plan(plans)

    def _source_shares(self, what: str, keys, values):
        """Each group's store with its share of all-layer source tensors, checked by that store."""
        shares = self._routing.source_shares(what, self.config, self.groups, keys, values)
        checked = [(s, *s.source_tensors(what, k, v)) for s, (k, v) in zip(self._stores, shares)]
        return [(s, k, v) for s, k, v, _ in checked], checked[0][3]

    def slot_buffers(self):
        """Every buffer of this cache that holds per-slot state (`LayerStore.slot_buffers`): each layer's
        keys and values, and the un-rotated sink keys of its ``"cache"``-mode rotations, in every group."""
        return tuple(self._slot_buffers())

    def _copy_slots(self, pairs: list) -> None:
        slot_copy.copy_slots(self._slot_buffers(), pairs)

    # -------------------------------------------------------------- attention

    def path_for(self, tokens: int, compiled: bool = True) -> str:
        """The attention path (`"rows"` or `"flex"`) a step of `tokens` tokens takes in a one-group
        cache, compiled or eagerly (`AttentionOptions.path_for`)."""
        return self._only_group("path_for").path_for(tokens, compiled)

    def _attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, *,
                scale: Optional[float] = None, score_mod: Optional[Callable] = None, positions: str = "stream",
                sinks: Optional[torch.Tensor] = None, want_lse: bool = False,
                query_only: Optional[torch.Tensor] = None, joined: Optional[Sequence[KeyPart]] = None):
        """Write the step's tokens into model layer `layer_idx` and attend over what each row may read,
        in the layer's group with the group's plan (`flexkv.cache.cache_group.CacheGroup._attend`, where
        the arguments are described; the modes: `flexkv.cache.attend_modes`). `plan` is this cache's
        `plan(step)`."""
        group, i, group_plan = self._group_call("attend", layer_idx, q, k, v, plan)
        return group._attend(i, q, k, v, group_plan, scale=scale, score_mod=score_mod, positions=positions,
                             sinks=sinks, want_lse=want_lse, query_only=query_only, joined=joined)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan, *,
               scale: Optional[float] = None, score_mod: Optional[Callable] = None, positions: str = "stream",
               sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`AttendModes.attend`, routed here straight to the group (the call every layer makes: one frame
        fewer between a model and its kernel)."""
        group, i, group_plan = self._group_call("attend", layer_idx, q, k, v, plan)
        return group._attend(i, q, k, v, group_plan, scale=scale, score_mod=score_mod, positions=positions,
                             sinks=sinks)

    def write_part(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, plan) -> KeyPart:
        """Write the step's tokens into model layer `layer_idx` as `attend` does, and return the cells each
        row's newest own token reads as a `KeyPart` another cache's `attend_joined` reads in its
        softmax (`CacheGroup.write_part`)."""
        group, i, group_plan = self._group_call("write_part", layer_idx, k, k, v, plan)
        return group.write_part(i, k, v, group_plan)

    def _group_call(self, what: str, layer_idx: int, q, k, v, plan) -> tuple:
        """`(group, layer in the group, the group's plan)` a call of `what` on model layer `layer_idx` goes to,
        its heads checked by the store factory's `check_heads` when it has one."""
        group, i, group_plan = self._routing.in_group(what, layer_idx, plan)
        if self._check_heads is not None:
            self._check_heads(group, q, k, v)
        return group, i, group_plan

    def extra_repr(self) -> str:
        if len(self._groups) == 1:
            return ""
        parts = []
        for lg, g in zip(self.groups, self._groups):
            label = f"{lg.name}: " if lg.name else ""
            parts.append(f"{label}layers {list(lg.layers)} keep {lg.retention} ({g.layout.slot_row_len} cells per slot row)")
        return "; ".join(parts)
