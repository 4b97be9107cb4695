"""What a source is: the tensors `add_source` and `add_private_source` take, and their checks.

A source is a read-only prefix every layer holds: keys `[num_layers,
rows_per_request, num_heads, L, head_dim]` and values the same with
`value_head_dim` (`L <= max_source_len`). A grouped cache takes all its
layers at once and gives each layer group its share (`split_source`); each
store checks its share's shape (`check_source_shapes`) before anything is
written, and the uncached twin runs the same checks, so every cache refuses
the same sources with the same messages.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ...config import BoundedKVConfig

__all__ = ["check_source_shapes", "split_source"]


def check_source_shapes(config: BoundedKVConfig, what: str, keys, values) -> int:
    """Raise unless `keys`, `values` are a source of `config`'s shape; returns its length `L`.

    Keys `[num_layers, rows_per_request, num_heads, L, head_dim]`, values the
    same with `value_head_dim`, `L <= max_source_len` (dtype and device are
    the store's to check).
    """
    c = config
    for name, t, dim, width in (("keys", keys, "head_dim", c.head_dim),
                                ("values", values, "value_head_dim", c.value_head_dim)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 5:
            raise ValueError(
                f"{what}: {name} must be [num_layers, rows_per_request, num_heads, L, {dim}] "
                f"= [{c.num_layers}, {c.rows_per_request}, {c.num_heads}, L, {width}], got {tuple(t.shape)}"
            )
        want = (c.num_layers, c.rows_per_request, c.num_heads, t.shape[3], width)
        if tuple(t.shape) != want:
            raise ValueError(f"{what}: {name} shape expected {want}, got {tuple(t.shape)}")
        if t.shape[3] > c.max_source_len:
            raise ValueError(
                f"{what}: source length {t.shape[3]} exceeds max_source_len={c.max_source_len}"
            )
    if keys.shape[:4] != values.shape[:4]:
        raise ValueError(f"{what}: keys {tuple(keys.shape)} and values {tuple(values.shape)} differ")
    return keys.shape[3]


def split_source(what: str, config: BoundedKVConfig, groups: Sequence, configs: Sequence[BoundedKVConfig],
                 keys, values) -> list:
    """All-layer source tensors as each group's share: `[(keys, values)]` per group, its layers in order.

    `keys`, `values` as for `BoundedKVManager.add_source` with all
    `config.num_layers` layers; refused when the groups' heads differ in size
    (one tensor cannot hold them). Checks the all-layer shape only: each
    group's store checks its share.
    """
    c = config
    shapes = {(cfg.num_heads, cfg.head_dim, cfg.value_head_dim) for cfg in configs}
    if len(shapes) > 1:
        raise ValueError(
            f"{what}: the groups hold heads of different sizes {sorted(shapes)} (kv heads, head_dim, "
            f"value_head_dim), so one all-layer tensor cannot carry a source; a cache whose groups differ in "
            f"head sizes takes no sources (give every group the config's heads to use them)"
        )
    for name, t in (("keys", keys), ("values", values)):
        if not isinstance(t, torch.Tensor) or t.dim() != 5 or t.shape[0] != c.num_layers:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{what}: {name} must be [num_layers={c.num_layers}, rows_per_request, num_heads, L, head_dim], "
                f"got {got}"
            )
    out = []
    for g in groups:
        idx = torch.tensor(g.layers, device=keys.device)
        out.append((keys.index_select(0, idx), values.index_select(0, idx)))
    return out
