"""Layer groups: which layers keep which part of every stream, and a step's plan per group.

Models mix layer types: Gemma 3 alternates five sliding-window layers with
one global layer, gpt-oss alternates sliding and global layers, and each
kind keeps a different part of the stream. A `LayerGroup` names layers that
keep the same part (a retention, a query window, head sizes);
`per_layer_groups` groups one retention per layer; `layer_group_configs`
checks the groups against a config and gives each its own config and each
model layer its `(group, index inside the group)`. A
`flexkv.cache.manager.BoundedKVManager` keeps one slot table and one
`flexkv.cache.cache_group.CacheGroup` per group, each with its own slot
size: a group whose window is 128 holds 128 cells per slot, not what the
widest group needs. With several groups its plan is a `GroupedPlan` (one
plan per group, from one read of the table) and a layer's rotary positions a
`GroupRotation` (the layer's group's rotation, given that plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from torch import nn

from ..config import BoundedKVConfig, Retention, SinkWindow, check_config, check_layer_index, is_int
from ..step import BoundedKVStep
from .host.planner import BoundedPlan
from .host.sources import split_source

__all__ = ["LayerGroup", "GroupedPlan", "GroupRotation", "GroupRouting", "OneGroup", "layer_group_configs",
           "per_layer_groups", "as_layer_groups"]


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


def layer_group_configs(config: BoundedKVConfig, groups: Optional[Sequence[LayerGroup]] = None):
    """Check `groups` against `config`; returns `(groups, configs, route)`.

    `configs[g]` is group `g`'s own `BoundedKVConfig` (its layers, retention,
    query window and any head sizes it sets; everything else shared), `route[layer]` the
    `(group, index inside the group)` of each model layer. `groups=None` is
    one group of every layer with `config`'s own retention. This is the one
    place a cache's per-group configs come from: `flexkv.cache.manager.BoundedKVManager`
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


class OneGroup:
    """How a one-group cache reaches its group (`GroupRouting`): its plans and rotations are the group's
    own, a model layer is the group's layer of the same index, and every source is the group's whole."""

    def __init__(self, groups: Sequence, route: tuple):
        self.group = groups[0]

    def only(self, what: str):
        return self.group

    def plan(self, plans: list):
        return plans[0]

    def rotation(self, g: int, rotation: nn.Module) -> nn.Module:
        return rotation

    def first_plan(self, plan) -> BoundedPlan:
        return plan

    def layer_plan(self, layer_idx: int, plan) -> BoundedPlan:
        return plan

    def in_group(self, what: str, layer_idx: int, plan) -> tuple:
        return self.group, layer_idx, plan  # the group checks the layer index and the plan itself

    def source_shares(self, what: str, config: BoundedKVConfig, layer_groups, keys, values) -> list:
        return [(keys, values)]


class GroupRouting:
    """How a cache of several layer groups reaches them: a `GroupedPlan` per step (one plan per group), a
    `GroupRotation` per rotated layer, each model layer routed to its group's layer, and all-layer
    sources split into each group's share. `OneGroup` is the one-group case; a `BoundedKVManager`
    takes one of the two when it is built, so no call asks how many groups there are."""

    def __init__(self, groups: Sequence, route: tuple):
        self.groups = tuple(groups)
        self.route = route  # model layer -> (group, layer in the group)

    def only(self, what: str):
        raise ValueError(
            f"BoundedKVManager.{what}: this cache has {len(self.groups)} layer groups, each with its own {what}; "
            f"read cache.cache_groups[g].{what} (cache.group_of(layer) gives a layer's group)")

    def plan(self, plans: list) -> GroupedPlan:
        return GroupedPlan(plans)

    def rotation(self, g: int, rotation: nn.Module) -> nn.Module:
        return GroupRotation(g, rotation)

    def _check(self, what: str, plan) -> None:
        if not isinstance(plan, GroupedPlan) or len(plan) != len(self.groups):
            raise ValueError(
                f"{what} needs this cache's GroupedPlan (one plan per group, {len(self.groups)} groups): "
                f"pass plan=cache.plan(step), got {plan!r}"
            )

    def first_plan(self, plan) -> BoundedPlan:
        if not isinstance(plan, GroupedPlan):
            raise ValueError(
                f"stream_positions needs this cache's GroupedPlan (cache.plan(step)), got {type(plan).__name__}")
        return plan.plans[0]

    def layer_plan(self, layer_idx: int, plan) -> BoundedPlan:
        return plan.plans[self.route[check_layer_index(layer_idx, len(self.route))][0]]

    def in_group(self, what: str, layer_idx: int, plan) -> tuple:
        self._check(what, plan)
        g, i = self.route[check_layer_index(layer_idx, len(self.route))]
        return self.groups[g], i, plan.plans[g]

    def source_shares(self, what: str, config: BoundedKVConfig, layer_groups, keys, values) -> list:
        return split_source(what, config, layer_groups, [g.config for g in self.groups], keys, values)
