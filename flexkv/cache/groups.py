"""Per-layer retention: layers grouped by what they keep, one slot table and a store per group.

Models mix layer types: Gemma 3 alternates five sliding-window layers with
one global layer, gpt-oss alternates sliding and global layers, and each
kind keeps a different part of the stream. `GroupedKVManager` is one
`flexkv.cache.host.slots.SlotTable` (the requests, their slots, written counts
and sources: the same for every group) and one device store per
`LayerGroup` (a `BoundedKVManager` over that shared table), each with its
own retention and so its own slot size: a group whose window is 128 holds
128 cells per slot, not what the widest group needs.

A step still goes `admit -> plan -> attend (per layer) -> commit`:

* `admit(step)` checks and admits the step once, in the shared table;
* `plan(step)` reads the table once and plans the step for each group's
  store (host ints, as `BoundedKVManager.plan`), returning a `GroupedPlan`;
* `attend(layer, ...)` runs the layer's one FlexAttention call in its group's
  store, with the group's plan and the layer's index inside the group;
* `commit(step)` records the written tokens once, in the table.

A source is checked for every group before any is written, then copied
into the same place of every group's tensors. Only what each group keeps
differs. The lifecycle members are `flexkv.cache.host.lifecycle.StreamLifecycle`'s
over the table and every group's store, as for every other cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import nn

from ..config import BoundedKVConfig, Retention, SinkWindow, check_config, check_layer_index, is_int, resolve_device
from ..step import BoundedKVStep
from .host.lifecycle import StreamLifecycle
from .host.planner import BoundedPlan
from .host.slots import SlotTable
from .host.sources import split_source
from .manager import BoundedKVManager
from .paths.joint_path import KeyPart

__all__ = ["LayerGroup", "GroupedKVManager", "GroupedPlan", "layer_group_configs", "per_layer_groups", "as_layer_groups",
           "build_cache"]



@dataclass(frozen=True)
class LayerGroup:
    """Layers that keep the same part of every stream.

    Args:
        layers: the model layer indices of the group (distinct ints >= 0).
        retention: a `SinkWindow` (or a callable `source_len -> SinkWindow`)
            for these layers.
        query_window: the group's per-query window (see `BoundedKVConfig`),
            or None for a per-step window.
        name: a label for reports (`"sliding_attention"`, ...).
        num_heads, head_dim, value_head_dim: the group's KV heads, key width
            and value width where they differ from the shared config's (Gemma
            4's full layers have wider heads than its sliding ones); None
            keeps the config's. A group that sets `head_dim` but not
            `value_head_dim` has values as wide as its keys, unless the config
            sets `value_head_dim`.
        causal_step: the group's per-step window is causal inside the step
            (see `BoundedKVConfig.causal_step`).
    """

    layers: Tuple[int, ...]
    retention: Retention
    query_window: Optional[int] = None
    name: str = ""
    num_heads: Optional[int] = None
    head_dim: Optional[int] = None
    value_head_dim: Optional[int] = None
    causal_step: bool = False

    def __post_init__(self):
        try:
            layers = tuple(self.layers)
        except TypeError:
            raise ValueError(f"LayerGroup.layers must be a sequence of layer indices, got {self.layers!r}") from None
        if not layers:
            raise ValueError("LayerGroup.layers is empty; a group needs at least one layer")
        for i in layers:
            if not is_int(i) or i < 0:
                raise ValueError(f"LayerGroup.layers must hold ints >= 0, got {i!r} in {list(layers)}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"LayerGroup.layers must be distinct, got {list(layers)}")
        object.__setattr__(self, "layers", layers)
        if not isinstance(self.retention, SinkWindow) and not callable(self.retention):
            raise ValueError(
                f"LayerGroup.retention must be a SinkWindow or a callable source_len -> SinkWindow, got {self.retention!r}"
            )
        if self.query_window is not None and (not is_int(self.query_window) or self.query_window < 0):
            raise ValueError(f"LayerGroup.query_window must be an int >= 0 or None, got {self.query_window!r}")
        if not isinstance(self.name, str):
            raise ValueError(f"LayerGroup.name must be a str, got {self.name!r}")
        for field_name in ("num_heads", "head_dim", "value_head_dim"):
            value = getattr(self, field_name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(
                    f"LayerGroup.{field_name} must be an int >= 1, or None for the config's, got {value!r}"
                )
        if not isinstance(self.causal_step, bool):
            raise ValueError(f"LayerGroup.causal_step must be a bool, got {self.causal_step!r}")

    def shape_overrides(self) -> dict:
        """The config fields this group sets for itself (`num_heads`, `head_dim`, `value_head_dim`)."""
        return {k: getattr(self, k) for k in ("num_heads", "head_dim", "value_head_dim") if getattr(self, k) is not None}


def _one_per_layer(name: str, value, layers: int, single: str) -> list:
    """`value` for each of `layers` layers: a list or tuple as given (one per layer), else repeated."""
    if not isinstance(value, (list, tuple)):
        return [value] * layers
    if len(value) != layers:
        raise ValueError(f"{name} names {len(value)} layers but retention names {layers}; give one per layer or {single}")
    return list(value)


def per_layer_groups(retention: Sequence[Retention], query_window=None,
                     causal_step: bool = False) -> Tuple[LayerGroup, ...]:
    """`LayerGroup`s from one retention per layer: layers whose retention, query window and
    `causal_step` are equal share a group (in order of their first layer).

    `retention[i]` is layer `i`'s `SinkWindow` (or callable `source_len -> SinkWindow`;
    callables are grouped by identity). `query_window`: one value (int or None) for every
    layer, or one per layer; `causal_step` likewise (a bool, or one per layer). A local/global
    model::

        per_layer_groups([SinkWindow(0, 127), SinkWindow(4, 1020)] * 6)
    """
    try:
        policies = list(retention)
    except TypeError:
        raise ValueError(f"retention must be a sequence with one policy per layer, got {retention!r}") from None
    if not policies:
        raise ValueError("retention is empty; give one SinkWindow per layer")
    windows = _one_per_layer("query_window", query_window, len(policies), "a single value")
    causal = _one_per_layer("causal_step", causal_step, len(policies), "a single bool")
    found: dict = {}
    for layer, (pol, qw, cs) in enumerate(zip(policies, windows, causal)):
        if not isinstance(pol, SinkWindow) and not callable(pol):
            raise ValueError(f"retention[{layer}] must be a SinkWindow or a callable source_len -> SinkWindow, got {pol!r}")
        key = (pol if isinstance(pol, SinkWindow) else id(pol), qw, cs)
        found.setdefault(key, (pol, qw, cs, []))[3].append(layer)
    return tuple(LayerGroup(tuple(layers), pol, qw, causal_step=cs) for pol, qw, cs, layers in found.values())


def as_layer_groups(config: BoundedKVConfig, groups) -> Tuple[LayerGroup, ...]:
    """The `LayerGroup`s a user means by `groups`: `LayerGroup`s as given, or one retention per
    layer (`SinkWindow`s or callables, `config.num_layers` of them; see `per_layer_groups`),
    each layer with `config.query_window` and `config.causal_step`."""
    try:
        items = tuple(groups)
    except TypeError:
        raise ValueError(
            f"groups must be a sequence of LayerGroups or one SinkWindow per layer, got {groups!r}") from None
    if items and all(isinstance(g, LayerGroup) for g in items):
        return items
    if items and not any(isinstance(g, LayerGroup) for g in items):
        if len(items) != config.num_layers:
            raise ValueError(
                f"groups gives {len(items)} per-layer retentions but config.num_layers={config.num_layers}; "
                f"give one SinkWindow per layer, or LayerGroups"
            )
        return per_layer_groups(items, config.query_window, config.causal_step)
    raise ValueError(
        f"groups must be LayerGroups, or one SinkWindow per layer (not a mix), got {list(items)!r}")


def build_cache(config: BoundedKVConfig, groups=None, device="cpu", *, block_size: Optional[int] = None):
    """The cache for `config`: a `BoundedKVManager`, or with `groups` (LayerGroups, or one
    retention per layer) a `GroupedKVManager` whose layer groups keep their own retention."""
    if groups is None:
        return BoundedKVManager(config, device, block_size=block_size)
    return GroupedKVManager(config, as_layer_groups(config, groups), device, block_size=block_size)


def layer_group_configs(config: BoundedKVConfig, groups: Optional[Sequence[LayerGroup]] = None):
    """Check `groups` against `config`; returns `(groups, configs, route)`.

    `configs[g]` is group `g`'s own `BoundedKVConfig` (its layers, retention,
    query window and any head sizes it sets; everything else shared), `route[layer]` the
    `(group, index inside the group)` of each model layer. `groups=None` is
    one group of every layer with `config`'s own retention. This is the one
    place a grouped cache's per-group configs come from: `GroupedKVManager`
    and the uncached twin (`flexkv.model.uncached.UncachedHistory`) both use it.
    """
    check_config(config)
    L = config.num_layers
    if groups is None:
        groups = (LayerGroup(tuple(range(L)), config.retention, config.query_window,
                             causal_step=config.causal_step),)
    groups = tuple(groups)
    if not groups:
        raise ValueError("groups is empty; give at least one LayerGroup (or None for one group of every layer)")
    for g in groups:
        if not isinstance(g, LayerGroup):
            raise ValueError(f"groups must hold LayerGroup objects, got {g!r}")
    route: list = [None] * L
    for gi, g in enumerate(groups):
        for li, layer in enumerate(g.layers):
            if layer >= L:
                raise ValueError(
                    f"group {gi} names layer {layer}, but config.num_layers={L} (layers 0..{L - 1})"
                )
            if route[layer] is not None:
                raise ValueError(f"layer {layer} is in groups {route[layer][0]} and {gi}; put each layer in one group")
            route[layer] = (gi, li)
    missing = [i for i, r in enumerate(route) if r is None]
    if missing:
        raise ValueError(f"layers {missing} are in no group; every layer of 0..{L - 1} needs one")
    configs = []
    for gi, g in enumerate(groups):
        try:
            configs.append(
                config.replace(num_layers=len(g.layers), retention=g.retention, query_window=g.query_window,
                               causal_step=g.causal_step, **g.shape_overrides())
            )
        except ValueError as exc:
            raise ValueError(f"group {gi} (layers {list(g.layers)}): {exc}") from None
    return groups, tuple(configs), tuple(route)


class GroupedPlan:
    """One step planned for every group: `plans[g]` is group `g`'s `BoundedPlan`."""

    def __init__(self, plans: Sequence[BoundedPlan]):
        self.plans = tuple(plans)
        self.rows = self.plans[0].rows
        self.tokens = self.plans[0].tokens

    def __getitem__(self, group: int) -> BoundedPlan:
        return self.plans[group]

    def __len__(self) -> int:
        return len(self.plans)

    def __eq__(self, other):
        if not isinstance(other, GroupedPlan):
            return NotImplemented
        return self.plans == other.plans

    __hash__ = None

    def __repr__(self):
        return f"GroupedPlan(groups={len(self.plans)}, rows={self.rows}, tokens={self.tokens})"


class GroupRotation(nn.Module):
    """One group's `flexkv.cache.positions.rotary.SinkRotation`, called with a `GroupedPlan` (it takes its group's plan)."""

    def __init__(self, group: int, rotation: nn.Module):
        super().__init__()
        self.group = group
        self.rotation = rotation

    def check_step(self, step: BoundedKVStep) -> None:
        self.rotation.check_step(step)

    @property
    def memory_bytes(self) -> int:
        return self.rotation.memory_bytes

    @property
    def slot_bytes(self) -> int:
        return self.rotation.slot_bytes

    def forward(self, q: torch.Tensor, k: torch.Tensor, plan: "GroupedPlan"):
        return self.rotation(q, k, plan.plans[self.group])


class GroupedKVManager(StreamLifecycle, nn.Module):
    """A bounded KV cache whose layer groups each keep their own sink + window.

    Args:
        config: what the groups share: `num_layers` (all layers, every one
            in exactly one group), heads, head dim, rows per request, slots,
            sources, dtype, `max_step_tokens`. Its own `retention` and
            `query_window` describe a single group of every layer when
            `groups` is None; with groups they are replaced by each group's.
        groups: the `LayerGroup`s; together they must cover
            `range(config.num_layers)` once.
        device, block_size: as for `BoundedKVManager`.
        manager: builds each group's store from its config and the shared
            slot table, `manager(config, slots)` (default:
            `BoundedKVManager(config, device, block_size=block_size,
            slots=slots)`); a tensor-parallel engine passes one that builds
            `flexkv.serving.distributed.ShardedKVManager`s.

    `slots` is the one `SlotTable` of every group; `managers[g]` is group
    `g`'s store, a `BoundedKVManager` over that table (its layer `i` is model
    layer `groups[g].layers[i]`).
    """

    def __init__(
        self,
        config: BoundedKVConfig,
        groups: Optional[Sequence[LayerGroup]] = None,
        device="cpu",
        *,
        block_size: Optional[int] = None,
        manager: Optional[Callable[[BoundedKVConfig, SlotTable], BoundedKVManager]] = None,
    ):
        super().__init__()
        check_config(config)
        groups, configs, route = layer_group_configs(config, groups)
        if manager is None:
            def manager(cfg, slots):
                return BoundedKVManager(cfg, device, block_size=block_size, slots=slots)
        elif not callable(manager):
            raise ValueError(f"manager must be a callable (config, slots) -> BoundedKVManager, got {manager!r}")
        self.config = config
        self.groups = groups
        self.device = resolve_device(device)
        #: The requests, slots and sources of every group (`flexkv.cache.host.slots.SlotTable`).
        self.slots = SlotTable(config)
        built = [manager(c, self.slots) for c in configs]
        for gi, m in enumerate(built):
            if not isinstance(m, BoundedKVManager):
                raise ValueError(f"manager(config, slots) must return a BoundedKVManager, got {type(m).__name__} "
                                 f"for group {gi}")
            if m.slots is not self.slots:
                raise ValueError(f"manager(config, slots) must build group {gi}'s store over the slot table it is "
                                 f"given (BoundedKVManager(..., slots=slots))")
        self.managers = nn.ModuleList(built)
        # Host-side access without nn.ModuleList's indexing cost (it runs on every step).
        self._mgrs = tuple(self.managers)
        self._route = route
        self._lock = self.slots.lock
        self._stores = tuple(m.store for m in built)

    # ------------------------------------------------------------------ views

    def group_of(self, layer_idx: int) -> Tuple[int, int]:
        """`(group, index inside the group)` of model layer `layer_idx`."""
        return self._route[check_layer_index(layer_idx, len(self._route))]

    # ------------------------------------------------------ the cache protocol
    # What every flexkv cache offers the front doors above it (`flexkv.cache.protocol.StreamCache`).

    #: `attend` traces under `torch.compile(fullgraph=True)`.
    compilable = True

    def layer_config(self, layer_idx: int) -> BoundedKVConfig:
        """The config that governs model layer `layer_idx`: its group's (retention, windows)."""
        g, _ = self.group_of(layer_idx)
        return self._mgrs[g].config

    def rotation(self, layer_idx: int, rotary, mode: str = "stream", *, rotated_inputs: bool = False) -> "GroupRotation":
        """Rotary positions for model layer `layer_idx` (see `BoundedKVManager.rotation`), in its group;
        called with this cache's `GroupedPlan`."""
        g, i = self.group_of(layer_idx)
        return GroupRotation(g, self._mgrs[g].rotation(i, rotary, mode, rotated_inputs=rotated_inputs))

    def stream_positions(self, plan: GroupedPlan, tokens: Optional[int] = None) -> torch.Tensor:
        """Stream index of each of the step's own tokens, `[N, T]` (the same in every group)."""
        if not isinstance(plan, GroupedPlan):
            raise ValueError(f"stream_positions needs this cache's GroupedPlan (cache.plan(step)), got {type(plan).__name__}")
        return self._mgrs[0].stream_positions(plan.plans[0], tokens)

    @property
    def memory_bytes(self) -> int:
        """Bytes every group's key and value tensors hold."""
        return sum(m.memory_bytes for m in self._mgrs)

    @property
    def slot_bytes(self) -> int:
        """Bytes one request's slot holds over every group: the memory of one stream."""
        return sum(m.slot_bytes for m in self._mgrs)

    def memory_report(self) -> tuple:
        """One dict per group: its name, layers, retention, query window, KV heads, key and value
        widths, slot dtype (None: unquantized), cells per slot row, bytes per slot (over its layers,
        keys and values, scales included) and bytes held."""
        out = []
        for g, m in zip(self.groups, self._mgrs):
            out.append(
                dict(
                    name=g.name,
                    layers=g.layers,
                    retention=g.retention,
                    query_window=g.query_window,
                    num_heads=m.config.num_heads,
                    head_dim=m.config.head_dim,
                    value_head_dim=m.config.value_head_dim,
                    causal_step=g.causal_step,
                    slot_dtype=m.config.slot_dtype,
                    slot_cells=m.layout.slot_row_len,
                    slot_bytes=m.slot_bytes,
                    memory_bytes=m.memory_bytes,
                )
            )
        return tuple(out)

    # -------------------------------------------------------------- lifecycle
    # `StreamLifecycle` (flexkv.cache.host.lifecycle) writes the members once, over the one table and every
    # group's store: the table changes once, each store copies its own slots, each group's ring and
    # retention decide what can be taken back.

    def _plan_step(self, step, slots, private, eager_only) -> GroupedPlan:
        """One plan per group, from one read of the table."""
        return GroupedPlan([m.plan_from(step, slots, private, eager_only) for m in self._mgrs])

    def _source_shares(self, what: str, keys: torch.Tensor, values: torch.Tensor):
        """Each group's store with its share of all-layer source tensors, checked by that store."""
        shares = split_source(what, self.config, self.groups, [m.config for m in self._mgrs], keys, values)
        checked = [(m.store, *m.store.source_tensors(what, k, v)) for m, (k, v) in zip(self._mgrs, shares)]
        return [(store, k, v) for store, k, v, _ in checked], checked[0][3]

    # -------------------------------------------------------------- attention

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: GroupedPlan,
        *,
        scale: Optional[float] = None,
        score_mod: Optional[Callable] = None,
        positions: str = "stream",
        sinks: Optional[torch.Tensor] = None,
        return_lse: bool = False,
        query_only: Optional[torch.Tensor] = None,
        joined: Optional[Sequence[KeyPart]] = None,
    ) -> torch.Tensor:
        """`BoundedKVManager.attend` for model layer `layer_idx`, in its group with the group's plan."""
        m, i, group_plan = self._in_group_of("attend", layer_idx, plan)
        return m.attend(i, q, k, v, group_plan, scale=scale, score_mod=score_mod, positions=positions, sinks=sinks,
                        return_lse=return_lse, query_only=query_only, joined=joined)

    def write_part(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, plan: GroupedPlan) -> KeyPart:
        """`BoundedKVManager.write_part` for model layer `layer_idx`, in its group with the group's plan."""
        m, i, group_plan = self._in_group_of("write_part", layer_idx, plan)
        return m.write_part(i, k, v, group_plan)

    def _in_group_of(self, what: str, layer_idx: int, plan) -> tuple:
        """`(group's store, layer in the group, group's plan)` of model layer `layer_idx` under `plan`."""
        if not isinstance(plan, GroupedPlan) or len(plan) != len(self._mgrs):
            raise ValueError(
                f"{what} needs this cache's GroupedPlan (one plan per group, {len(self._mgrs)} groups): "
                f"pass plan=cache.plan(step), got {plan!r}"
            )
        g, i = self.group_of(layer_idx)
        return self._mgrs[g], i, plan.plans[g]

    def extra_repr(self) -> str:
        parts = []
        for g, m in zip(self.groups, self._mgrs):
            label = f"{g.name}: " if g.name else ""
            parts.append(
                f"{label}layers {list(g.layers)} keep {g.retention} ({m.layout.slot_row_len} cells per slot row)"
            )
        return "; ".join(parts)
