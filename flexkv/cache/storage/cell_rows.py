"""A layer tensor's cells read as whole rows: any cells of any heads in one copy, dequantized if stored in 8 bits.

A layer tensor is `[1, H, S, width]`; viewed as `[H * S, width]`, head `h`'s
cell `c` is row `h * S + c`. A path that reads scattered cells of every head
(the memory blocks a `Recall` step chose, its window's cells beside them)
names them as such rows and reads them with one `index_select`, several
times faster on the CPU than indexing by a head tensor and a cell tensor.
Compiled, the read is one op opaque to the graph (`gather_head_cells`), so
inductor copies the rows as they are rather than generating a slower gather
loop for them; a read of a few hundred cells a head (what a `Recall` step
copies of its memory) is faster as inductor's own loop, fused with what
consumes it (`fused=True`: SmolLM2's 30-layer compiled decode step, 6.3-6.4
ms with the opaque copy, 5.0-5.9 ms fused, alternating runs).
"""

from __future__ import annotations

from typing import Optional

import torch

from .quantized import dequantize

__all__ = ["gather_head_cells", "read_cells"]


@torch.library.custom_op("flexkv::gather_head_cells", mutates_args=())
def gather_head_cells(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """Rows `flat` of layer tensor `x` (`[1, H, S, width]`) viewed as `[H * S, width]` (row `h * S + cell`
    is head `h`'s cell): `[len(flat), width]`. One op opaque to a compiled graph: inductor calls
    `index_select` as it is (a row copy) instead of generating a slower gather loop for it."""
    return x.reshape(-1, x.shape[-1]).index_select(0, flat)


@gather_head_cells.register_fake
def _(x, flat):
    return x.new_empty(flat.shape[0], x.shape[-1])


def _rows(x: torch.Tensor, flat: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """`gather_head_cells(x, flat)`, compiled unless `fused`; else `index_select` itself (eagerly a custom op's
    dispatch costs more than the copy; compiled, inductor then generates the gather)."""
    if torch.compiler.is_compiling() and not fused:
        return gather_head_cells(x, flat)
    return x.reshape(-1, x.shape[-1]).index_select(0, flat)


def read_cells(kc: torch.Tensor, scale: Optional[torch.Tensor], flat: torch.Tensor, work: torch.dtype,
               dtype: torch.dtype, fused: bool = False) -> torch.Tensor:
    """Rows `flat` (`[N, H, L]`, head `h`'s cell `c` as `h * S + c`) of a layer tensor `[1, H, S, D]`,
    dequantized into the cache's `dtype`, then widened to `work`: `[N, H, L, D]`. Read as whole rows of
    the flattened `[H * S, D]` tensor (`index_select`: several times faster on the CPU than indexing by a
    head and a cell tensor). `fused`: compiled, a gather inductor generates (a few hundred cells a head)."""
    N, H, L = flat.shape
    flat = flat.reshape(-1)
    out = _rows(kc, flat, fused).view(N, H, L, -1)
    if scale is None:
        return out.to(work)
    # As every path reads a quantized cell back (`quantized.dequantize`), then widened.
    return dequantize(out, _rows(scale, flat, fused).view(N, H, L, 1), dtype).to(work)
