"""Each batch row's cells, read from a layer tensor for the rows path.

A layer tensor is `[1, H, S, width]` (keys, values, or their scales). The
rows path attends a batch of rows `[B, H, W, width]`, read in one of two ways
(`batch_cells`):

- **in place**: the slot pool viewed as slot rows, no copy;
- **gathered**: each row's `W` cells (`[B, W]` cell indices) copied side by
  side.

Compiled, the gather of a step's keys and values is one op opaque to the
graph (`gather_kv`, `flexkv::gather_kv`): inductor calls it as it is rather
than generating, scheduling and building a gather kernel per tensor in every
layer of the step. A gather is a plain row copy that inductor cannot fuse
into the attention kernel it feeds, so the op costs the step nothing and
takes two kernels per layer out of its compile.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["batch_cells", "gather_kv"]


def batch_cells(x: torch.Tensor, b0: int, b1: int, cells: Optional[torch.Tensor], base: int, row_len: int,
                out: Optional[torch.Tensor] = None):
    """Batch rows `b0..b1` of layer tensor `x` (`[1, H, S, width]`: cells or scales) as
    `[b1 - b0, H, W, width]`: slot rows read in place (`cells` None: `row_len` cells from `base`
    per slot row) or each row's cells gathered (`cells`: `[B, W]` cell indices), into `out`
    (`[H, (b1 - b0) * W, width]`) if given."""
    H, w = x.shape[1], x.shape[-1]
    if cells is None:
        return x[0, :, base + b0 * row_len:base + b1 * row_len].view(H, b1 - b0, row_len, w).transpose(0, 1)
    W = cells.shape[1]
    rows = cells if b0 == 0 and b1 == cells.shape[0] else cells[b0:b1]  # (each op is traced in every layer)
    return torch.index_select(x[0], 1, rows.reshape(-1), out=out).view(H, b1 - b0, W, w).transpose(0, 1)


@torch.library.custom_op("flexkv::gather_kv", mutates_args=())
def gather_kv(keys: torch.Tensor, values: torch.Tensor, cells: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cells `cells` (`[B, W]`) of layer tensors `keys` and `values` (`[1, H, S, width]`): each
    `[B, H, W, width]`, as `batch_cells` gathers them."""
    B = cells.shape[0]
    return batch_cells(keys, 0, B, cells, 0, 0), batch_cells(values, 0, B, cells, 0, 0)


@gather_kv.register_fake
def _(keys, values, cells):
    B, W = cells.shape
    # index_select's result is contiguous `[H, B * W, width]`, viewed as `batch_cells` views it.
    return tuple(x.new_empty(x.shape[1], B, W, x.shape[3]).transpose(0, 1) for x in (keys, values))
