"""Copying whole slots on the device: what a fork and a reorder do to a cache's tensors.

A slot is a contiguous run of cells in every buffer that holds per-slot
state (`flexkv.cache.layout`: a slot's `rows_per_request` slot rows lie one
after the other). Copying slot `a` to slot `b` copies that run, in every
layer's key and value tensor and in any other per-slot buffer (the
un-rotated sink keys of ``"cache"`` rotary positions), with one
`index_select` and one `index_copy_` per buffer for all pairs at once.

All sources are gathered before any destination is written, so a
destination may also be a source (a beam search's reorder) and an error
while gathering changes nothing.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence, Tuple

import torch

__all__ = ["SlotBuffer", "copy_slots"]


class SlotBuffer(NamedTuple):
    """A tensor holding `per_slot` cells of slot `s` at `base + s * per_slot ..` along dimension `dim`."""

    tensor: torch.Tensor
    dim: int
    base: int
    per_slot: int


def _cells(buf: SlotBuffer, slots: Sequence[int]) -> torch.Tensor:
    offsets = torch.arange(buf.per_slot)
    starts = torch.tensor([buf.base + s * buf.per_slot for s in slots], dtype=torch.long)
    return (starts.view(-1, 1) + offsets.view(1, -1)).view(-1).to(buf.tensor.device, non_blocking=True)


def copy_slots(buffers: Iterable[SlotBuffer], pairs: Sequence[Tuple[int, int]]) -> None:
    """Copy slot `src` onto slot `dst` for every `(src, dst)` of `pairs` (destinations distinct), in
    every buffer; every source is read as it was before the call."""
    if not pairs:
        return
    src = [a for a, _ in pairs]
    dst = [b for _, b in pairs]
    if len(set(dst)) != len(dst):
        raise ValueError(f"copy_slots: destination slots must be distinct, got {dst}")
    buffers = list(buffers)
    with torch.no_grad():
        staged = []
        for buf in buffers:
            staged.append((buf, buf.tensor.index_select(buf.dim, _cells(buf, src)), _cells(buf, dst)))
        for buf, values, index in staged:
            buf.tensor.index_copy_(buf.dim, index, values)
