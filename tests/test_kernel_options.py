"""`flex_kernel_options` on hand-worked shapes (pure Python: no device, no compile)."""

import pytest
import torch

from flexkv.cache.paths.kernel_options import decode_block_m, decode_split_kv, flex_kernel_options, uses_decode_kernel

BF16 = torch.bfloat16


def opts(q_len, q_heads=32, kv_heads=8, *, head_dim=128, dtype=BF16, block=128, device="cuda", **kw):
    return flex_kernel_options(device, q_len, kv_heads, q_heads, head_dim, dtype, block, **kw)


def test_cpu_takes_no_options():
    assert opts(1, device="cpu") is None
    assert opts(33, block=8, device="cpu") is None  # CUDA-only limits do not apply


def test_decode_tile_worked_examples():
    # 4-way GQA: the decode kernel packs q_len * 4 query rows into one power-of-two tile (>= 16).
    assert decode_block_m(1, 4) == 16
    assert decode_block_m(9, 4) == 64  # 36 rows
    assert decode_block_m(32, 4) == 128
    assert decode_block_m(33, 4) == 256  # 132 rows: no longer divides a query block of 128
    assert uses_decode_kernel(1, 32, 8)
    assert uses_decode_kernel(127, 8, 8)
    assert not uses_decode_kernel(128, 8, 8)  # long queries: main kernel
    assert not uses_decode_kernel(1, 12, 4)  # 3-way GQA is not a power of two: main kernel


def test_gqa4_decode_that_fits_one_query_block_keeps_torch_defaults():
    assert opts(1) is None
    assert opts(32) is None  # 128 rows: the largest tile that divides the query block


def test_gqa4_from_33_tokens_takes_the_main_kernel():
    assert opts(33) == {"FORCE_USE_FLEX_ATTENTION": True}
    assert opts(100, q_heads=16) == {"FORCE_USE_FLEX_ATTENTION": True}  # 2-way: 200 rows -> tile 256
    assert opts(33, q_heads=8) is None  # no GQA: 33 rows -> tile 64, fine
    assert opts(128) is None  # main kernel anyway


@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
def test_a_decode_shape_leaves_the_decode_kernel_exactly_when_its_tile_would_not_divide_the_query_block(group):
    """The decode kernel's tile packs `q_len * group` query rows, rounded up to a power of two of at
    least 16; a tile that does not divide the 128-row query block has no valid config. Worked out here
    without the module's own helpers."""
    for q_len in range(1, 128):
        rows = q_len * group
        tile = 16
        while tile < rows:
            tile *= 2
        forced = (opts(q_len, q_heads=2 * group, kv_heads=2) or {}).get("FORCE_USE_FLEX_ATTENTION", False)
        assert forced == (128 % tile != 0), (q_len, group, tile)


def test_kv_block_sizes():
    assert opts(1, block=256) is None
    assert opts(1, block=64) == {"BLOCK_N": 64}  # torch's Hopper main-kernel tile for bf16 d64 is 128
    assert opts(200, block=16) == {"BLOCK_N": 16}
    assert opts(200, block=96) == {"BLOCK_N": 32}
    assert opts(200, block=192) == {"BLOCK_N": 64}
    assert opts(33, block=32) == {"BLOCK_N": 32, "FORCE_USE_FLEX_ATTENTION": True}
    for bad in (8, 24, 100):
        with pytest.raises(ValueError, match=f"KV block size {bad} cannot run on CUDA"):
            opts(1, block=bad)


def test_decode_tuning_needs_the_capability():
    hopper = (9, 0)
    assert opts(1, capability=hopper) == {"BLOCK_N": 64, "num_warps": 2, "num_stages": 3}
    assert opts(9, capability=hopper) == {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}  # 64-row tile
    assert opts(32, capability=hopper) == {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3}  # 128-row tile
    # fp32 with a wide head keeps one stage, as torch's own table has it.
    assert opts(1, dtype=torch.float32, head_dim=256, capability=hopper)["num_stages"] == 1
    # Ampere: warps follow the tile, stages stay torch's.
    assert opts(32, capability=(8, 0)) == {"BLOCK_N": 64, "num_warps": 8}
    # The main kernel is never tuned here.
    assert opts(33, capability=hopper) == {"FORCE_USE_FLEX_ATTENTION": True}
    assert opts(1, block=32, capability=hopper)["BLOCK_N"] == 32


def test_decode_split_kv_worked_examples():
    assert decode_split_kv(64, 8, 132) == 1  # 512 (row, head) pairs already fill an H100/H200
    assert decode_split_kv(4, 8, 132) == 8  # 132 // 32 * 2
    assert decode_split_kv(1, 1, 132) == 264


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="q_heads=12 must be a multiple of kv_heads=8"):
        opts(1, q_heads=12)
    with pytest.raises(ValueError, match="q_len must be an int >= 1"):
        opts(0)
    with pytest.raises(ValueError, match="q_block_size=64 must be a multiple of 128"):
        opts(1, q_block_size=64)
    with pytest.raises(ValueError, match="device_type must be a str"):
        flex_kernel_options(torch.device("cuda"), 1, 8, 32, 128, BF16, 128)


def test_head_dim_below_16_is_refused_on_cuda_only():
    with pytest.raises(ValueError, match=r"head_dim=8 cannot run on CUDA.*at least 16.*use head_dim >= 16"):
        opts(1, head_dim=8)
    assert opts(1, head_dim=16) is None
    assert opts(1, head_dim=8, device="cpu") is None
    assert opts(1, head_dim=4, device="meta") is None


def test_every_torch_workaround_is_named_where_flexkv_works_around_it():
    """The registry and the code agree: each entry's name appears in flexkv outside the registry (the code or
    the docstring of what works around it), and every `TORCH_WORKAROUNDS["..."]` the code names is registered."""
    import re
    from pathlib import Path

    import flexkv
    from flexkv.cache.paths.attention_options import TORCH_WORKAROUNDS

    root = Path(flexkv.__file__).parent
    registry = root / "cache" / "paths" / "attention_options.py"
    text = {p: p.read_text() for p in root.rglob("*.py")}
    named = {m for p, t in text.items() for m in re.findall(r'TORCH_WORKAROUNDS\["(\w+)"\]', t)}
    assert named - set(TORCH_WORKAROUNDS) == set(), "named in the code but not registered"
    for name in TORCH_WORKAROUNDS:
        elsewhere = [p for p, t in text.items() if p != registry and name in t]
        in_registry_code = text[registry].count(name) > 1  # the entry itself, and a use in the same module
        assert elsewhere or in_registry_code, f"TORCH_WORKAROUNDS[{name!r}] is named nowhere in flexkv's code"
