"""vLLM's CPU KV-cache layout, as flexkv reads it.

vLLM's CPU backend stores a layer's cache as `[blocks, kv_heads, block_size, 2 * head_size]`: per block
and head, a region of `block_size * head_size` key elements, then one of value elements. Inside a
region the order is the kernel's own, chosen per instruction set (`cpu_attn_reshape_and_cache`,
with the ISA vLLM picked for the layer): on x86 with the `vec` kernels keys are stored dimension-major
(`[head_size, block_size]`) and values token-major (`[block_size, head_size]`); AMX and other ISAs
pack differently.

flexkv does not assume any of these orders. `region_order` asks vLLM's own write where each element
lands: it writes one block of keys and values whose elements are their own token index, then their
own dimension index, and reads the cache back. The answer is a permutation `[block_size, head_size]`
-> offset in the region, checked to cover every offset once. `RegionReader` then gathers keys or values
through it: a plain view where the order is token-major or dimension-major (the common cases), one
indexed gather otherwise. `element_index` names the elements of whole entries (key and value) in the
layer's cache flattened, so a few entries are read or written with one `index_select` or `index_copy_`
whatever the order.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["region_order", "RegionReader", "split_cache", "element_index"]


def split_cache(kv_cache):
    """`(key_cache, value_cache)`, each `[blocks, heads, block_size, head_size]` views of vLLM's CPU cache
    (their regions in vLLM's order, not necessarily token-major)."""
    blocks, heads, bs, _ = kv_cache.shape
    return kv_cache.view(blocks, heads, 2 * bs, -1).chunk(2, dim=2)


def element_index(blocks: torch.Tensor, offsets: torch.Tensor, orders, heads: int) -> torch.Tensor:
    """`[..., 2, heads, head_size]` int64: where the key (`[..., 0]`) and value (`[..., 1]`) elements of the entries
    at `blocks` and in-block `offsets` (both `[...]`) lie in a layer's cache `[blocks, heads, block_size, 2 *
    head_size]` flattened, its regions in the `orders` (`(key_order, value_order)`, `region_order`'s)."""
    order = torch.stack(tuple(orders))  # [2, block_size, head_size]
    bs, d = order.shape[1:]
    within = order[:, offsets].movedim(0, -2).unsqueeze(-2)  # [..., 2, 1, head_size]
    kind = torch.arange(2).view(2, 1, 1)
    head = torch.arange(heads).view(1, heads, 1)
    region = (blocks.to(torch.long)[..., None, None, None] * heads + head) * 2 + kind  # [..., 2, heads, 1]
    return region * (bs * d) + within


@functools.lru_cache(maxsize=None)
def region_order(isa: str, dtype: torch.dtype, block_size: int, head_size: int):
    """`(key_order, value_order)`: `[block_size, head_size]` int64, the offset in a block's key (value) region
    where vLLM's CPU write puts token `t`, dimension `d`. Raises `ValueError` when the write does not
    place every element exactly once (a layout flexkv cannot read)."""
    import vllm._custom_ops as ops  # only where vLLM is installed

    exact = 256 if dtype == torch.bfloat16 else 2048  # integers the probe's dtype holds exactly
    if max(block_size, head_size) > exact:
        raise ValueError(f"flexkv reads vLLM's CPU cache layout by probing it, which needs block_size and head_size "
                         f"<= {exact} in {dtype}; got block_size={block_size}, head_size={head_size}")
    orders = []
    tokens = torch.arange(block_size)[:, None, None].expand(block_size, 1, head_size)
    dims = torch.arange(head_size)[None, None, :].expand(block_size, 1, head_size)
    found = {}
    for name, pattern in (("token", tokens), ("dim", dims)):
        kv = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
        kc, vc = split_cache(kv)
        x = pattern.to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(x, x, kc, vc, torch.arange(block_size, dtype=torch.long), isa)
        found[name] = (kc[0, 0].flatten().long(), vc[0, 0].flatten().long())
    for which in (0, 1):
        tok, dim = found["token"][which], found["dim"][which]
        order = torch.full((block_size, head_size), -1, dtype=torch.long)
        order[tok, dim] = torch.arange(block_size * head_size)
        if (order < 0).any() or (tok * head_size + dim).unique().numel() != block_size * head_size:
            raise ValueError(f"vLLM's CPU write (isa {isa!r}, {dtype}, block_size {block_size}, head_size "
                             f"{head_size}) does not place each element of a block once: flexkv cannot read it")
        orders.append(order)
    return tuple(orders)


class RegionReader:
    """Gathers `[T, S, heads, head_size]` entries of one cache (`[blocks, heads, block_size, head_size]`
    regions) at blocks `[T, S]` and in-block offsets `[T, S]`, through `order` (`region_order`)."""

    def __init__(self, order: torch.Tensor) -> None:
        bs, d = order.shape
        t, dd = torch.arange(bs)[:, None], torch.arange(d)[None, :]
        self.kind = "token" if torch.equal(order, t * d + dd) else "dim" if torch.equal(order, dd * bs + t) else "any"
        self.order = order

    def __call__(self, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        nb, h, bs, d = cache.shape
        if self.kind == "token":
            return cache[blocks, :, offsets]
        region = cache.flatten(2)
        if self.kind == "dim":  # the region is [head_size, block_size]
            return region.unflatten(2, (d, bs))[blocks, :, :, offsets]
        idx = self.order[offsets]  # [T, S, D]
        return region[blocks[..., None, None], torch.arange(h)[:, None], idx[:, :, None, :]]
