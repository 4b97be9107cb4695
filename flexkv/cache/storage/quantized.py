"""Quantized slots: key and value cells stored in 8 bits, each with its own scale.

A cache whose config sets `slot_dtype` (`torch.int8` or `torch.float8_e4m3fn`)
keeps every cell of its layer tensors (sources, sinks, ring and scratch alike)
in that dtype, next to one float32 scale per cell and KV head, for keys and
values separately:

- **write** (`quantize`): a token's key (or value) of one head, `x` of
  `head_dim` numbers, is stored as `round(x / s)` (int8, in [-127, 127]) or
  `x / s` rounded to float8 e4m3 (in [-448, 448]), with `s = max|x| / 127`
  (int8) or `max|x| / 448` (float8) and `s = 1` for an all-zero `x`. The
  scale is per cell and head because that is what a write produces: a step
  writes whole tokens, so every stored number is a function of the token's
  own vector alone. Nothing is ever re-quantized: a cell keeps the error of
  its one write however often the ring wraps past it (under in-cache rotary
  positions the sink cells are written again at every step, each time from
  the sink's unquantized copy, so each holds one write's error), and the
  largest entry of every vector (an outlier included) is stored exactly at
  the top of the range rather than clipped.
- **read** (`dequantize`): `cells.float() * scale`, cast to the cache's
  `dtype`, where a path reads cells: the rows path (eager and compiled CPU)
  a group of rows at a time (`flexkv.cache.cpu.quantized_rows`; float32 steps
  apply the scales to the scores and probabilities instead, equal to a few
  ulps); the FlexAttention path on a dequantized copy
  of the layer tensor (a value scale per cell cannot be applied inside one
  softmax, and FlexAttention's CPU kernel and eager mode take no mixed
  dtypes). Compiled CUDA kernels may instead read float8 cells as stored
  (`CELLS_IN_KERNEL`; `AttentionOptions.quantized_keys_in_kernel`, key
  scales in `score_mod`, and `quantized_values_in_kernel`, two calls:
  `value_scaled_attention`).

Since quantization is a pure function of each written vector, the dense
reference runs on `round_trip(x)` of every key and value it is given and the
cache must agree with it as closely as with an unquantized cache
(`tests/random_workload.py`, `flexkv.model.uncached`).

Sources are quantized too, once, when registered (they are read-only, so
their error never grows): a source is the same kind of cell as any other and
a cache's savings cover them. Memory per cell and head is `head_dim` bytes
plus 4 for the scale (`cell_bytes`): 0.52x of bfloat16 at `head_dim = 128`,
0.53x at 64.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ...config import SLOT_DTYPES

__all__ = ["SLOT_DTYPES", "SLOT_DTYPE_NAMES", "SCALE_DTYPE", "slot_dtype_named", "quantize", "dequantize",
           "dequantize_into", "widen_into", "F8_WIDEN_FACTOR",
           "round_trip", "cell_bytes", "key_scale_score_mod", "value_scale_score_mod",
           "value_scaled_attention", "lse_values", "LSE_VALUE_WIDTH", "CELLS_IN_KERNEL"]

#: The largest magnitude each cell dtype holds after scaling.
_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
#: Names for configuration files and the command line.
SLOT_DTYPE_NAMES = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn}
#: Every scale is float32: it spans any magnitude a key or value of any cache dtype can have.
SCALE_DTYPE = torch.float32


def slot_dtype_named(name) -> Optional[torch.dtype]:
    """The slot dtype of a name in a configuration file (`"int8"`, `"fp8"`, `"float8_e4m3fn"`; None or
    `"none"`: unquantized)."""
    if name is None or name == "none":
        return None
    if name not in SLOT_DTYPE_NAMES:
        raise ValueError(f"slot_dtype must be one of none, {', '.join(SLOT_DTYPE_NAMES)}, got {name!r}")
    return SLOT_DTYPE_NAMES[name]


def quantize(x: torch.Tensor, slot_dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """`x [..., D]` -> `(cells [..., D] in slot_dtype, scale [..., 1] float32)`, one scale per vector."""
    qmax = _QMAX[slot_dtype]
    xf = x.to(SCALE_DTYPE)
    top = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(top > 0, top / qmax, torch.ones((), dtype=SCALE_DTYPE, device=x.device))
    # In place after the division: each fresh buffer of a chunk's size costs its pages again.
    y = torch.div(xf, scale).clamp_(-qmax, qmax)
    if slot_dtype == torch.int8:
        y.round_()
    return y.to(slot_dtype), scale


def dequantize(cells: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored cells back to numbers: `cells * scale` (in float32), cast to `dtype`."""
    out = dequantize_into(torch.empty(cells.shape, dtype=SCALE_DTYPE, device=cells.device), cells, scale)
    return out if out.dtype == dtype else out.to(dtype)


def dequantize_into(out: torch.Tensor, cells: torch.Tensor, scale: torch.Tensor,
                    staging: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`cells * scale` in float32, written into `out` (float32, the cells' shape); returns `out`.

    The cells are widened into `out` (`widen_into`), then multiplied in place by the scale and
    the widening's factor together (a pass over the scales, a `head_dim`-th of the cells): one
    multiply with type promotion from int8 runs several times slower on the CPU. Exactly
    `cells.to(float32) * scale`: `out` holds the cells times a power of two and the scale is
    multiplied by its inverse, so the product has the same exact value and rounds the same."""
    out, factor = widen_into(out, cells, staging)
    return out.mul_(scale if factor == 1.0 else scale * factor)


def widen_into(out: torch.Tensor, cells: torch.Tensor, staging: Optional[torch.Tensor] = None):
    """The cells as float32 numbers divided by a power of two, written into `out`: returns
    `(out, factor)` with `out * factor == cells.to(float32)` exactly.

    int8 cells: one copy, factor 1. float8 e4m3 cells on the CPU are widened through their bits
    (`_float8_bits_to_float16`, factor `2**8`), since torch widens float8 one element at a time
    there, some fifty times slower than int8; `staging` is an int16 tensor of the cells' shape
    for their bits (made here if None). Elsewhere, a plain conversion, factor 1."""
    if cells.dtype == torch.float8_e4m3fn and cells.device.type == "cpu":
        if staging is None:
            staging = torch.empty(cells.shape, dtype=torch.int16, device=cells.device)
        return out.copy_(_float8_bits_to_float16(staging, cells)), F8_WIDEN_FACTOR
    return out.copy_(cells), 1.0


#: float8 e4m3 bits `s eeee mmm` placed as float16 bits `s 0eeee mmm0000000`: that float16 is the
#: float8 number times 2**-8 (float16's exponent bias is 15, float8's 7), float8 subnormals as
#: float16 subnormals, and it widens to float32 exactly (torch's float16 conversion is vectorised).
F8_WIDEN_FACTOR = 2.0 ** 8
_F8_TO_F16_SHIFT = 7
_F8_TO_F16_MASK = -0x4080  # 0xbf80 as int16: the sign bit and the 7 exponent/mantissa bits


def _float8_bits_to_float16(staging: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
    """float8 e4m3 cells as float16 numbers times 2**-8, exactly, built in `staging` (int16, the
    cells' shape) in three integer passes over two-byte numbers; returns `staging` viewed as
    float16.

    Viewed as int8 and widened to int16 (sign-extended), a cell's bits shifted left by 7 hold its
    sign at bit 15 (bit 14 too, which the mask clears) and its exponent and mantissa at the bottom
    of float16's exponent and the top of its mantissa. The exponent then reads 8 too low: the
    number is the float8 one times 2**-8, subnormal in float16 for float8 subnormals, which are
    subnormal there too. NaN cells (never written: a cell is clamped to +-448) read as +-480."""
    staging.copy_(cells.view(torch.int8))
    # The shift as a multiply (|int8| <= 128, so no product leaves int16): torch's in-place left
    # shift allocates a result and copies it back.
    staging.mul_(1 << _F8_TO_F16_SHIFT).bitwise_and_(_F8_TO_F16_MASK)
    return staging.view(torch.float16)


def round_trip(x: torch.Tensor, slot_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """What a cache with `slot_dtype` reads back for `x` (x itself when unquantized)."""
    if slot_dtype is None:
        return x
    return dequantize(*quantize(x, slot_dtype), x.dtype)


def cell_bytes(width: int, dtype: torch.dtype, slot_dtype: Optional[torch.dtype]) -> int:
    """Bytes one cell of one head holds for a vector of `width` numbers (its scale included)."""
    if slot_dtype is None:
        return width * torch.empty((), dtype=dtype).element_size()
    return width * torch.empty((), dtype=slot_dtype).element_size() + torch.empty((), dtype=SCALE_DTYPE).element_size()


def key_scale_score_mod(k_scale: torch.Tensor, group: int, inner=None):
    """A `score_mod` that multiplies a score by its key's scale, then runs `inner` (if any).

    For FlexAttention reading quantized key cells directly: `k_scale` is the
    layer's `[1, H, S, 1]` scale buffer; `group` how many query heads share a
    KV head in the call's `h` (1 when GQA groups are folded into the query axis
    or there is no GQA; the ratio when `enable_gqa` maps query heads).
    """
    ks = k_scale[0, :, :, 0]

    def score_mod(score, b, h, q_idx, kv_idx):
        score = score * ks[h // group if group > 1 else h, kv_idx]
        return score if inner is None else inner(score, b, h, q_idx, kv_idx)

    return score_mod


#: Devices whose FlexAttention kernels read float8 cells given with higher-precision queries
#: (widened in registers), and in which mode: CUDA's compiled kernels (torch 2.11 on); eager
#: `flex_attention`, and the compiled CPU kernel, take no mixed dtypes.
CELLS_IN_KERNEL = {"cuda": "compiled"}


def value_scale_score_mod(v_scale: torch.Tensor, group: int, inner=None):
    """A `score_mod` that runs `inner` (if any), then adds the log of its value's scale.

    Under it, FlexAttention's weights are `exp(score) * v_scale` over a sum of the same, so the
    output is the attention over the dequantized values divided by `sum exp(score) * v_scale /
    sum exp(score)`: `value_scaled_attention` multiplies that back. `v_scale`, `group`: as
    `key_scale_score_mod`'s. A zero scale (never written: an all-zero vector stores scale 1)
    would give a weight of zero, which is what its cell contributes."""
    vs = v_scale[0, :, :, 0]

    def score_mod(score, b, h, q_idx, kv_idx):
        score = score if inner is None else inner(score, b, h, q_idx, kv_idx)
        return score + torch.log(vs[h // group if group > 1 else h, kv_idx])

    return score_mod


#: Value head size of the second call `value_scaled_attention` makes for the plain log-sum-exp
#: (the smallest FlexAttention's kernels take); its values are a zero cell repeated (stride 0).
LSE_VALUE_WIDTH = 16


def lse_values(slot_dtype: torch.dtype, device) -> torch.Tensor:
    """The one zero cell (`[1, 1, 1, LSE_VALUE_WIDTH]` of `slot_dtype`) that `value_scaled_attention`'s
    second call reads as every value, expanded."""
    return torch.zeros(1, 1, 1, LSE_VALUE_WIDTH, dtype=slot_dtype, device=device)


def value_scaled_attention(call, v_cells: torch.Tensor, v_scale: torch.Tensor, group: int, inner, zero_cell):
    """Attention over value cells stored with a scale per cell, read as stored: two kernel calls.

    `call(values, score_mod)` runs the step's attention (its queries, keys and mask fixed) and
    returns `(out, lse)`; `inner` is the step's own `score_mod` (or None), `group` as
    `key_scale_score_mod`'s. One softmax cannot weight each value by its own scale, so:

    1. `call(v_cells, inner + log v_scale)` gives `out1 = sum_i e_i s_i c_i / sum_i e_i s_i` and
       `lse1 = log sum_i e_i s_i` (`e_i = exp(score_i)`, `s_i` the scale, `c_i` the cell);
    2. `call(zero cells, inner)` gives the step's own `lse = log sum_i e_i` (its output, of
       `LSE_VALUE_WIDTH` zeros, is not used; `zero_cell` expanded reads one cell);
    3. the output is `out1 * exp(lse1 - lse) = sum_i e_i s_i c_i / sum_i e_i`, the attention over
       the dequantized values, and `lse` is the step's.

    A query that reads nothing (`lse = -inf`) gets zeros. Returns `(out, lse)`: `out` in `out1`'s
    dtype, rescaled in float32."""
    out, lse_scaled = call(v_cells, value_scale_score_mod(v_scale, group, inner))
    _, lse = call(zero_cell.expand(v_cells.shape[:3] + (zero_cell.shape[-1],)), inner)
    ratio = torch.where(lse > float("-inf"), torch.exp(lse_scaled.float() - lse.float()), 0.0)
    return (out.float() * ratio.unsqueeze(-1)).to(out.dtype), lse
