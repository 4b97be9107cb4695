"""Reading vLLM's CPU cache layout (flexkv.integrations.vllm.cpu_layout): whatever order vLLM's own write
uses on this machine, flexkv reads back exactly what was written. Skipped where vLLM is not installed."""

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm._custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from flexkv.integrations.vllm.cpu_layout import RegionReader, element_index, region_order, split_cache  # noqa: E402


@pytest.mark.parametrize("dtype, block, head", [(torch.float32, 32, 64), (torch.bfloat16, 32, 64),
                                                (torch.float32, 64, 32), (torch.float32, 32, 48)])
@pytest.mark.parametrize("generic", [False, True])
def test_what_vllms_write_stores_reads_back_exactly(dtype, block, head, generic):
    torch.manual_seed(0)
    isa = _get_attn_isa(dtype, block, head, "auto")
    heads, nblocks, tokens = 2, 6, 150
    kv = torch.zeros(nblocks, heads, block, 2 * head, dtype=dtype)
    key_cache, value_cache = split_cache(kv)
    keys, values = torch.randn(tokens, heads, head).to(dtype), torch.randn(tokens, heads, head).to(dtype)
    slots = torch.randperm(nblocks * block)[:tokens]
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    read_k, read_v = (RegionReader(order) for order in region_order(isa, dtype, block, head))
    if generic:  # the indexed gather every layout falls back to
        read_k.kind = read_v.kind = "any"
    idx = torch.randperm(tokens)[:96].view(8, 12)  # [T, S] tokens to read
    blocks, offsets = slots[idx] // block, slots[idx] % block
    assert torch.equal(read_k(key_cache, blocks, offsets), keys[idx])
    assert torch.equal(read_v(value_cache, blocks, offsets), values[idx])
    if not generic:
        # the same entries named element by element in the flattened cache: read, then written elsewhere
        at = element_index(blocks, offsets, region_order(isa, dtype, block, head), heads)  # [8, 12, 2, H, D]
        got = kv.view(-1).index_select(0, at.flatten()).view(at.shape)
        assert torch.equal(got[:, :, 0], keys[idx]) and torch.equal(got[:, :, 1], values[idx])
        free = torch.tensor(sorted(set(range(nblocks * block)) - set(slots.tolist()))[:36]).view(3, 12)
        kv.view(-1).index_copy_(0, element_index(free // block, free % block, region_order(isa, dtype, block, head),
                                                 heads).flatten(), got[:3].flatten())
        assert torch.equal(read_k(key_cache, free // block, free % block), keys[idx[:3]])
        assert torch.equal(read_v(value_cache, free // block, free % block), values[idx[:3]])


def test_the_probe_finds_a_permutation():
    isa = _get_attn_isa(torch.float32, 32, 64, "auto")
    for order in region_order(isa, torch.float32, 32, 64):
        assert sorted(order.flatten().tolist()) == list(range(32 * 64))
