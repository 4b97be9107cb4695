"""Copying whole slots on the device: what a fork and a reorder do to a cache's tensors.

A slot is a contiguous run of cells in every buffer that holds per-slot
state (`flexkv.cache.host.layout`: a slot's `rows_per_request` slot rows lie one
after the other). Copying slot `a` to slot `b` copies that run, in every
layer's key and value tensor and in any other per-slot buffer (the
un-rotated sink keys of ``"cache"`` rotary positions): per buffer, the
sources are gathered into one tensor (`torch.cat` of their runs), then each
run is written to its destination. Copying whole runs reads and writes each
slot's cells as contiguous blocks (an `index_select` of single cells along
the cell axis ran about 10x slower on the CPU).

All sources are gathered before any destination is written, so a
destination may also be a source (a beam search's reorder) and an error
while gathering changes nothing.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence, Tuple

import torch

__all__ = ["SlotBuffer", "copy_slots", "plan_slot_rows"]


class SlotBuffer(NamedTuple):
    """A tensor holding `per_slot` cells of slot `s` at `base + s * per_slot ..` along dimension `dim`."""

    tensor: torch.Tensor
    dim: int
    base: int
    per_slot: int


def copy_slots(buffers: Iterable[SlotBuffer], pairs: Sequence[Tuple[int, int]]) -> None:
    """Copy slot `src` onto slot `dst` for every `(src, dst)` of `pairs` (destinations distinct), in
    every buffer; every source is read as it was before the call."""
    if not pairs:
        return
    dst = [b for _, b in pairs]
    if len(set(dst)) != len(dst):
        raise ValueError(f"copy_slots: destination slots must be distinct, got {dst}")
    buffers = list(buffers)
    with torch.no_grad():
        staged = []
        for buf in buffers:
            runs = [buf.tensor.narrow(buf.dim, buf.base + a * buf.per_slot, buf.per_slot) for a, _ in pairs]
            staged.append(torch.cat(runs, buf.dim))
        for buf, values in zip(buffers, staged):
            for i, (_, b) in enumerate(pairs):
                buf.tensor.narrow(buf.dim, buf.base + b * buf.per_slot, buf.per_slot).copy_(
                    values.narrow(buf.dim, i * buf.per_slot, buf.per_slot))


def plan_slot_rows(plan, slots_base: int, slot_row_len: int, spare: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """`(rows, live)`, each `[N]` on the device: the slot row each plan row writes (`spare`, the row kept for
    them, for padding rows, whose regions the planner points out of reach) and whether it is a request's.
    For state kept per slot row beside the layer tensors (`SlotBuffer`s with a spare row)."""
    sink_base = plan.sink_base.long()
    live = sink_base >= slots_base
    return torch.where(live, (sink_base - slots_base) // slot_row_len, spare), live
