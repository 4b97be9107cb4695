"""A served prompt chunk past eviction, one layer: the per-token gather, the tiled path and vLLM's kernel, side by side.

    python -m benchmarks.vllm_chunk_attention [--positions 4000] [--queries 512] [--window 1020] [--threads 1]

SmolLM2's attention shape (3 KV heads, 3 queries each, head 64) over a paged cache of 32-token blocks:
one request's chunk of `--queries` tokens ending at `--positions`, through
`flexkv.integrations.vllm.backend.sink_window_attention` (every query gathers its own sink + window + 1
keys) and `band_attention` (a tile of queries gathers one span), each timed by
`torch.utils.benchmark` in turn, and their largest difference. Beside them, what stock vLLM runs for a
plain sliding window of the same `sink + window + 1` keys: its CPU kernel
(`cpu_attention_with_kv_cache`) over the same chunk, in float32 (the speed a chunk past eviction is
measured against; it attends another set of keys, so its output is not compared). Needs the `vllm`
extra's environment.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.benchmark import Timer


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--positions", type=int, default=4000)
    ap.add_argument("--queries", type=int, default=512)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=1020)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    from flexkv.integrations.vllm.backend import band_attention, sink_window_attention

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    h, g, d, bs = 3, 3, 64, 32
    blocks = a.positions // bs + 2
    kc, vc = torch.randn(blocks + 1, h, bs, d), torch.randn(blocks + 1, h, bs, d)
    table = torch.randperm(blocks)[None].to(torch.int32) + 1
    q = torch.randn(a.queries, h * g, d)
    starts = torch.tensor([0, a.queries], dtype=torch.int32)
    seq = torch.tensor([a.positions], dtype=torch.int32)
    outs = {}
    for name, fn in (("per-token gather", sink_window_attention), ("tiled", band_attention)):
        out = outs[name] = torch.zeros_like(q)
        call = (lambda fn=fn, out=out: fn(q, kc, vc, table, starts, seq, a.sink, a.window, d ** -0.5, out))
        ms = Timer(stmt="call()", globals={"call": call}).blocked_autorange(min_run_time=1.0).median * 1e3
        print(f"{name:17s} {ms:8.1f} ms for {a.queries} queries at {a.positions} positions (one layer)")
    print(f"largest difference {float((outs['tiled'] - outs['per-token gather']).abs().max()):.2e}")
    ms = kernel_ms(q, table, starts, seq, blocks + 1, h, bs, d, a.sink + a.window + 1)
    print(f"{'vLLM kernel':17s} {ms:8.1f} ms for the same chunk under a plain sliding window of "
          f"{a.sink + a.window + 1} keys")


def kernel_ms(q, table, starts, seq, blocks: int, h: int, bs: int, d: int, reach: int) -> float:
    """Median ms of vLLM's CPU attention kernel over the chunk with a sliding window of `reach` keys."""
    import vllm.envs as envs
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(torch.float32, bs, d, "auto")
    kc, vc = torch.randn(blocks, h, bs, d), torch.randn(blocks, h, bs, d)  # any contents: the time is the same
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=q.shape[1], num_kv_heads=h, head_dim=d, seq_lens=seq, dtype=q.dtype,
        query_start_loc=starts, causal=True, sliding_window_size=reach, isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype="auto")
    out = torch.empty_like(q)

    def call():
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=kc, value_cache=vc, output=out, query_start_loc=starts, seq_lens=seq,
            scale=d ** -0.5, causal=True, alibi_slopes=None, sliding_window=reach, block_table=table, softcap=0,
            scheduler_metadata=meta, s_aux=None)

    return Timer(stmt="call()", globals={"call": call}).blocked_autorange(min_run_time=1.0).median * 1e3


if __name__ == "__main__":
    main()
