"""A served decode step past eviction, one layer: vLLM's kernel alone against flexkv's paths, side by side.

    python -m benchmarks.vllm_decode_attention [--requests 16] [--positions 600] [--window 252] [--threads 1]

SmolLM2's attention shape (3 KV heads, 3 queries each, head 64) over a paged cache of 32-token blocks in
vLLM's own CPU layout, `--requests` requests each decoding its token at stream index `--positions - 1`:

- `vLLM kernel`: stock vLLM's step for a plain sliding window of `sink + window + 1` keys (the speed
  target; another set of keys, so not compared);
- `sinks in place`: flexkv's step with prefix caching off (`FlexKVCPUImpl._decode_in_window`: the
  sinks copied below each window through vLLM's write, then the same kernel);
- `sinks in scratch`: the same with prefix caching on (a block copied into each request's scratch
  block first, the kernel reading the step's table with the scratch in place);
- `batched`: the torch path over the same step (`sink_window_attention`).

Each timed by `torch.utils.benchmark` in turn, the step's plan, element indices and kernel schedule made
once outside the timing, as each engine makes them once per step for all its layers. Printed: median microseconds per layer and the largest
difference between the three flexkv paths (they attend the same keys). Needs the `vllm` extra's
environment.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.benchmark import Timer


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--positions", type=int, default=600)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=252)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    import vllm.envs as envs
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from flexkv import SinkWindow
    from flexkv.integrations.vllm.backend import (
        FlexKVCPUImpl,
        decode_batch,
        decode_elements,
        decode_plan,
        sink_window_attention,
        step_gather,
    )
    from flexkv.integrations.vllm.cpu_layout import RegionReader, region_order, split_cache

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    h, g, d, bs, dtype = 3, 3, 64, 32, torch.float32
    R, pos = a.requests, a.positions
    per = pos // bs + 3  # each request's blocks, the two scratch blocks included
    isa = _get_attn_isa(dtype, bs, d, "auto")
    kv_cache = torch.zeros(R * per + 1, h, bs, 2 * d)
    key_cache, value_cache = split_cache(kv_cache)
    table = (torch.randperm(R * per) + 1).view(R, per).to(torch.int32)
    # every entry written through vLLM's write, in its layout
    slots = (table[:, :, None].long() * bs + torch.arange(bs)).view(R, -1)[:, :pos].reshape(-1)
    ops.cpu_attn_reshape_and_cache(torch.randn(slots.numel(), h, d), torch.randn(slots.numel(), h, d), key_cache,
                                   value_cache, slots, isa)
    q = torch.randn(R, h * g, d)
    starts = torch.arange(R + 1, dtype=torch.int32)
    seq = torch.full((R,), pos, dtype=torch.int32)
    reach = a.sink + a.window + 1
    scale = d ** -0.5

    impl = FlexKVCPUImpl.__new__(FlexKVCPUImpl)  # the method as the engine runs it, without an engine around it
    impl.retention, impl.head_size, impl.num_heads, impl.num_kv_heads = SinkWindow(a.sink, a.window), d, h * g, h
    impl.scale, impl.kv_cache_dtype = scale, "auto"
    impl._readers = tuple(RegionReader(order) for order in region_order(isa, dtype, bs, d))
    layer = type("Layer", (), {"isa": isa, "_k_scale_float": 1.0, "_v_scale_float": 1.0})()
    batch = decode_batch(table, starts, seq)  # the whole step: every request decodes

    sched = ops.cpu_attn_get_scheduler_metadata(  # stock vLLM makes it once per step, in its metadata builder
        num_reqs=R, num_heads=h * g, num_kv_heads=h, head_dim=d, seq_lens=seq, dtype=dtype, query_start_loc=starts,
        causal=True, sliding_window_size=reach, isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        kv_cache_dtype="auto")

    def kernel(out, block_table):
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
            seq_lens=seq, scale=scale, causal=True, alibi_slopes=None, sliding_window=reach,
            block_table=block_table, softcap=0, scheduler_metadata=sched, s_aux=None)

    plans = {name: decode_plan(table, seq, a.sink, a.window, bs, scratch=name == "sinks in scratch")
             for name in ("sinks in place", "sinks in scratch")}
    moves = {name: decode_elements(plan, tuple(r.order for r in impl._readers), h) for name, plan in plans.items()}
    memos = {name: {} for name in plans}  # what the engine keeps per step for every layer (made on the first call)
    gather = step_gather(table, starts, seq, R, a.sink, a.window, bs, h * d * 4, pos)
    outs = {name: torch.zeros(R, h * g, d) for name in ("vLLM kernel", "sinks in place", "sinks in scratch",
                                                          "batched")}
    calls = {
        "vLLM kernel": lambda: kernel(outs["vLLM kernel"], table),
        "sinks in place": lambda: impl._decode_in_window(layer, q, kv_cache, key_cache, value_cache, batch,
                                                         outs["sinks in place"], memos["sinks in place"],
                                                         plans["sinks in place"], moves["sinks in place"], None),
        "sinks in scratch": lambda: impl._decode_in_window(layer, q, kv_cache, key_cache, value_cache, batch,
                                                           outs["sinks in scratch"], memos["sinks in scratch"],
                                                           plans["sinks in scratch"], moves["sinks in scratch"],
                                                           None),
        "batched": lambda: sink_window_attention(q, key_cache, value_cache, table, starts, seq, a.sink, a.window,
                                                 scale, outs["batched"], gather=gather, max_len=pos,
                                                 read_keys=impl._readers[0], read_values=impl._readers[1]),
    }
    print(f"{R} requests decoding at stream index {pos - 1}, sink {a.sink} + window {a.window}, {a.threads} "
          f"thread(s), one layer:")
    for name, call in calls.items():
        us = Timer(stmt="call()", globals={"call": call}).blocked_autorange(min_run_time=1.0).median * 1e6
        print(f"{name:17s} {us:8.1f} us")
    ref = outs["batched"]
    print("largest difference from batched: " + ", ".join(
        f"{name} {float((outs[name] - ref).abs().max()):.1e}" for name in ("sinks in place", "sinks in scratch")))


if __name__ == "__main__":
    main()
