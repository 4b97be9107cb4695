"""`kernel_options` for FlexAttention on CUDA, decided from static shapes only.

Everything here is plain integer arithmetic on values that are fixed while a
step is traced (lengths, head counts, block sizes, dtype); nothing reads a
device. The rules come from torch's inductor lowering of FlexAttention
(`torch/_inductor/kernel/flex/flex_attention.py`, `flex_decoding.py`,
`flex_cpu.py` and the Triton templates next to them, read at torch 2.13 and
at a later pytorch revision that names the decode error):

1. **Which kernel.** Inductor lowers a short query to the *decode* kernel
   (`_use_flex_decoding`): query length `< 128`, batch and head counts static,
   the block mask's head dimension 1 (always so in flexkv), the GQA group
   `q_heads // kv_heads` a power of two, and neither `FORCE_USE_FLEX_ATTENTION`
   nor `OUTPUT_MAX` set. Anything else uses the main kernel.
2. **Decode tile over the query.** The decode kernel packs a KV head's whole
   query group into one tile: `BLOCK_M = max(next_pow2(q_len * group), 16)`
   unless given, and every candidate config whose `BLOCK_M` does not divide
   the block mask's query block size is dropped. With no candidate left the
   compile fails (`NoValidChoicesError`, or "Invalid FlexAttention decode
   kernel options" in the releases that name it). flexkv's query block is 128,
   so `q_len * group > 128` fails: 4-way GQA from `T = 33` on. Those shapes
   get `FORCE_USE_FLEX_ATTENTION`, which takes the main kernel (a query tile
   per head, no packing) and works for every release, instead of a `BLOCK_M`
   that relies on the multi-tile decode grid of recent releases.
3. **KV tile.** Both Triton kernels `static_assert` that the block mask's KV
   block size is a multiple of their `BLOCK_N` (and at least it). The decode
   kernel caps its `BLOCK_N` (64 by default) at the KV block size; the main
   kernel takes `BLOCK_N` from a per-GPU table (32, 64 or 128: 128 for 16-bit
   `head_dim` 64 on Hopper) without capping it, and with a single default
   config a mismatch raises "Q and KV block size must be divisible by BLOCK_M
   and BLOCK_N". `tl.dot` needs tiles of at least 16 and `tl.arange` a power
   of two. So a KV block size must be a multiple of 16 on CUDA (16 is the
   smallest that works); when it is not a multiple of 128, `BLOCK_N` is pinned
   to its largest power-of-two divisor, at most 64.
4. **Decode tuning (Hopper, Blackwell).** torch's table for sm_90/sm_100 means
   `num_stages=3` for decode, but the branch after it overwrites that with
   `num_stages=1` (an `if`/`if`/`else` in
   `CUDAConfigHeuristic.get_flex_decode_configs`), and `num_warps` stays 2
   whatever the tile, so a 128-row tile (`q_len * group = 65..128`) keeps a
   128x`head_dim` fp32 accumulator in 64 threads. With `capability` given, the
   decode kernel gets `BLOCK_N=64`, `num_stages=3` on sm_90/sm_100/sm_103
   (1 for fp32 with `head_dim > 128`, as torch's own table has it) and
   `num_warps` 2/4/8 for tiles of up to 32/64/128 rows on any CUDA GPU.

5. **Head size.** The CUDA lowering raises "NYI: embedding dimension of the
   query, key, and value must be at least 16" for a smaller head (the same
   `tl.dot` limit; present from torch 2.8 through 2.13): such a head is
   refused when the cache is built, not at its first compiled step.

Not decided here, and why:

- `SPLIT_KV` (decode): torch picks `max(sm_count // (batch * kv_heads) * 2, 1)`
  (`decode_split_kv`). When the block mask carries full blocks
  (`full_kv_num_blocks` not None, which flexkv passes even when the planner
  lists none), each split covers `KV_LEN / SPLIT_KV` positions of the row's
  block list, where `KV_LEN` is the whole cache tensor: a row's few dozen
  blocks then land in the first split (masked blocks) and the last one (full
  blocks) and the other splits idle. Passing a larger `SPLIT_KV` does not
  help; only `cdiv(kv_num_blocks * block, SPLIT_KV)` (no full blocks) splits a
  row evenly. It matters when `batch * kv_heads < sm_count / 2`; the remedy
  is to pass `full_kv_num_blocks=None` when a step has no full blocks (or to
  plan none for small decode batches), not a kernel option.
- `ROWS_GUARANTEED_SAFE` must stay False (padding rows attend nothing),
  `BLOCKS_ARE_CONTIGUOUS` False (a row's blocks jump at the ring's wrap), and
  `IS_DIVISIBLE` is left to torch (a decode query is never a multiple of 128).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ...config import is_int

__all__ = ["flex_kernel_options", "uses_decode_kernel", "decode_block_m", "decode_split_kv", "MIN_CUDA_KV_BLOCK",
           "MIN_CUDA_HEAD_DIM"]

#: Smallest KV block size the CUDA kernels compile for (a `tl.dot` tile is at least 16 wide).
MIN_CUDA_KV_BLOCK = 16
#: Smallest head size inductor's CUDA FlexAttention lowering accepts (the same `tl.dot` limit; it
#: raises NotImplementedError below it, in every release from 2.8 through 2.13 at least).
MIN_CUDA_HEAD_DIM = 16
#: Query length from which inductor always uses the main kernel.
_DECODE_MAX_Q_LEN = 128
#: Architectures whose torch decode table intends `num_stages=3`.
_PIPELINED_DECODE = {(9, 0), (10, 0), (10, 3)}


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _int(name: str, value, lo: int) -> int:
    if not is_int(value) or value < lo:
        raise ValueError(f"flex_kernel_options: {name} must be an int >= {lo}, got {value!r}")
    return value


def uses_decode_kernel(q_len: int, q_heads: int, kv_heads: int) -> bool:
    """Whether inductor lowers this call to the decode kernel (block mask with one head, static shapes)."""
    return 0 < q_len < _DECODE_MAX_Q_LEN and q_heads % kv_heads == 0 and _pow2(q_heads // kv_heads)


def decode_block_m(q_len: int, group: int) -> int:
    """The decode kernel's default query tile: the group's queries packed, rounded up to a power of two (>= 16)."""
    return max(_next_pow2(q_len * group), 16)


def decode_split_kv(batch: int, kv_heads: int, sm_count: int) -> int:
    """The `SPLIT_KV` torch's decode kernel picks by default (`get_split_k`): two splits per SM, at least one."""
    return max(sm_count // max(batch * kv_heads, 1) * 2, 1)


def flex_kernel_options(
    device_type: str,
    q_len: int,
    kv_heads: int,
    q_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_block_size: int,
    *,
    q_block_size: int = 128,
    capability: Optional[Tuple[int, int]] = None,
) -> Optional[dict]:
    """`kernel_options` for one `flex_attention` call, or None when torch's defaults are right.

    Pass the shapes exactly as `flex_attention` receives them: `q_len` and
    `q_heads` of the query after any folding of GQA groups into the query
    axis, `kv_heads` of the key, and the block mask's `BLOCK_SIZE`
    (`q_block_size`, `kv_block_size`). Whether the block mask carries
    full-block tensors changes no option (see the module notes on
    `SPLIT_KV`). `capability`: the CUDA device's `(major, minor)`, read once
    by the caller; without it only the options that make a shape compile are
    set, none that only tune speed.

    Returns None on the CPU (its C++ kernel takes none of these options) and
    on CUDA when nothing needs changing. Raises ValueError for a KV block size
    the CUDA kernels cannot compile (not a multiple of 16).
    """
    if not isinstance(device_type, str):
        raise ValueError(f"flex_kernel_options: device_type must be a str such as 'cuda', got {device_type!r}")
    _int("q_len", q_len, 1)
    _int("kv_heads", kv_heads, 1)
    _int("q_heads", q_heads, 1)
    _int("head_dim", head_dim, 1)
    _int("kv_block_size", kv_block_size, 1)
    _int("q_block_size", q_block_size, 1)
    if q_heads % kv_heads:
        raise ValueError(
            f"flex_kernel_options: q_heads={q_heads} must be a multiple of kv_heads={kv_heads}"
        )
    if device_type != "cuda":
        return None
    if head_dim < MIN_CUDA_HEAD_DIM:
        raise ValueError(
            f"head_dim={head_dim} cannot run on CUDA: FlexAttention's CUDA lowering refuses embedding sizes "
            f"below {MIN_CUDA_HEAD_DIM} (tl.dot needs tiles of at least 16; torch 2.8 to 2.13 raise \"NYI: "
            f"embedding dimension ... must be at least 16\" when the step compiles); use head_dim >= "
            f"{MIN_CUDA_HEAD_DIM} (zero-pad q, k and v to 16 and drop the padded output columns) or keep the cache "
            f"on the CPU"
        )
    if q_block_size % 128:
        raise ValueError(
            f"flex_kernel_options: q_block_size={q_block_size} must be a multiple of 128 on CUDA "
            f"(torch's main-kernel query tiles go up to 128 and must divide it)"
        )
    if kv_block_size % MIN_CUDA_KV_BLOCK:
        raise ValueError(
            f"KV block size {kv_block_size} cannot run on CUDA: FlexAttention's Triton kernels need it to be a "
            f"multiple of a power-of-two tile of at least {MIN_CUDA_KV_BLOCK}; use a block_size that is a multiple "
            f"of {MIN_CUDA_KV_BLOCK} (128 lets torch keep its own tiles)"
        )
    opts: dict = {}
    if kv_block_size % 128:
        # Largest power of two dividing the block, at most 64: valid for both kernels (TORCH_WORKAROUNDS["KV_TILE"]).
        opts["BLOCK_N"] = min(kv_block_size & -kv_block_size, 64)
    group = q_heads // kv_heads
    if uses_decode_kernel(q_len, q_heads, kv_heads):
        block_m = decode_block_m(q_len, group)
        if q_block_size % block_m:
            opts["FORCE_USE_FLEX_ATTENTION"] = True  # TORCH_WORKAROUNDS["DECODE_TILE"]
        elif capability is not None:  # TORCH_WORKAROUNDS["DECODE_STAGES"]
            opts.setdefault("BLOCK_N", 64)  # not yet set: the block is a multiple of 128
            opts["num_warps"] = 2 if block_m <= 32 else 4 if block_m <= 64 else 8
            if tuple(capability) in _PIPELINED_DECODE:
                opts["num_stages"] = 1 if dtype == torch.float32 and head_dim > 128 else 3
    return opts or None
