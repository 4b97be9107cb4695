"""Attention over gathered rows, a group of rows at a time in a buffer the cache allocates once.

Rows that do not read in place (they read a shared source beside their slot,
or the step holds few of the pool's slot rows) have their cells copied side
by side before SDPA (`row_cells.batch_cells`). Copied for the whole step at
once, the keys and values are two fresh tensors the size of a layer's
retained cells (29 MB per layer for a DiT step of 16 rows over a voice
prompt), whose pages the allocator maps anew on every call: touching them
cost as much as SDPA itself. `gathered_attention` instead copies a group of
rows into the cache's gather buffer (`gather_scratch`, about
`GATHER_GROUP_BYTES`) and attends it while its cells are still in the CPU's
caches, then the next group, the way quantized cells are widened
(`quantized_rows.grouped_attention`). The buffer is for caches with sources,
whose rows gather at every step (`gather_scratch` says which); others keep
gathering the step at once.

It is one op opaque to a compiled graph (`flexkv::gathered_rows_attention`):
inductor sees the step's queries, the layer tensors, the mask bias and the
cells, and the buffer the op writes. It covers SDPA without a `score_mod` or
a log-sum-exp; a step with either gathers the whole step (`row_cells.gather_kv`
when compiled).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..paths.row_cells import batch_cells

__all__ = ["gathered_attention", "attend_group", "gather_scratch", "GATHER_GROUP_BYTES"]

#: Rows are gathered and attended in groups whose keys and values take about this many bytes.
GATHER_GROUP_BYTES = 4 << 20


def gather_scratch(config, width: int, device) -> Optional[torch.Tensor]:
    """The buffer (the cache's dtype, `GATHER_GROUP_BYTES`) groups of gathered rows are copied into:
    keys and values of rows of `width` cells (`row_attention.gather_width`). Only a cache with
    sources gets one, whose rows gather at every step (without sources only steps holding few of
    the slot rows gather, measured no faster with it), and only where it is worth its bytes: one
    row must fit in it, and every row gathered at once must not (a smaller step's fresh tensors
    stay small). Otherwise None: the step is gathered at once, as before."""
    if not (config.max_sources and config.max_source_len):
        return None
    per_row = config.num_heads * width * (config.head_dim + config.value_head_dim)
    rows = config.max_slots * config.rows_per_request
    group = GATHER_GROUP_BYTES // torch.empty((), dtype=config.dtype).element_size()
    if not per_row <= group < rows * per_row:
        return None
    return torch.empty(group, dtype=config.dtype, device=device)


@torch.library.custom_op("flexkv::gathered_rows_attention", mutates_args=("scratch",))
def gathered_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                       cells: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """SDPA of `q` (`[B, H, Q, D]`, scaled) over the cells `cells` (`[B, W]`) of layer tensors `keys` and
    `values` (`[1, H, S, D]`, `[1, H, S, Dv]`) under the additive mask `bias` (`[B, 1, Q, W]`), a group
    of rows at a time copied into `scratch` (`gather_scratch`). Returns `[B, H, Q, Dv]`; a query
    that reads no cell gets zeros (SDPA's own result on the CPU)."""
    B, H = q.shape[:2]
    per_row = H * cells.shape[1] * (keys.shape[-1] + values.shape[-1])
    step = max(1, min(B, scratch.numel() // per_row))
    if step == B:  # contiguous, as the op's fake says (SDPA's output is laid out as the queries are)
        return attend_group(q, keys, values, bias, cells, scratch).contiguous()
    return torch.cat([attend_group(q[b0:b0 + step], keys, values, bias[b0:b0 + step], cells[b0:b0 + step], scratch)
                      for b0 in range(0, B, step)])


def attend_group(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, cells: torch.Tensor,
                 scratch: torch.Tensor) -> torch.Tensor:
    """One group of `gathered_attention`: rows `cells` (`[n, W]`) copied into the front of `scratch`, then SDPA."""
    n, W = cells.shape
    H, D, Dv = keys.shape[1], keys.shape[-1], values.shape[-1]
    k = batch_cells(keys, 0, n, cells, 0, 0, out=scratch[:n * H * W * D].view(H, n * W, D))
    v = batch_cells(values, 0, n, cells, 0, 0, out=scratch[n * H * W * D:n * H * W * (D + Dv)].view(H, n * W, Dv))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)


@gathered_attention.register_fake
def _(q, keys, values, bias, cells, scratch):
    return q.new_empty(q.shape[:3] + (values.shape[-1],))
