"""What the optional cross-rank plan check costs next to planning itself.

Run with:

    torchrun --nproc_per_node 2 benchmarks/tp_plan_check.py [--batch 32] [--iters 500]

Each rank holds a sharded cache on the `meta` device (planning never touches
device data, so no KV memory is needed) for a streaming-llm decode batch and
times, per step: `plan` alone, the two digests, and `plan` followed by
`check_in_sync` (one all-gather of a few dozen bytes over the job's
backend). The ranks run nothing else, so the check's time is its own, not
time spent waiting for a slower rank.
"""

from __future__ import annotations

import argparse
import time

import torch.distributed as dist

from flexkv import BoundedKVConfig, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.serving.distributed import ShardedKVManager, plan_digest


def timed(fn, iters: int) -> float:
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--window", type=int, default=1020)
    ap.add_argument("--iters", type=int, default=500)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = BoundedKVConfig(4, 8, 64, 1, 0, SinkWindow(4, args.window), max_slots=args.batch, max_sources=0)
    m = ShardedKVManager(cfg, "meta", process_group=dist.group.WORLD)
    ids = [f"r{i}" for i in range(args.batch)]
    first = BoundedKVStep(tuple(Segment(r, 1) for r in ids), {r: StreamPosition(0, 0) for r in ids})
    m.admit(first)
    m.commit(first)
    step = BoundedKVStep(tuple(Segment(r, 1) for r in ids), {r: StreamPosition(0, 1) for r in ids})
    m.admit(step)
    plan = m.plan(step)

    def plan_and_check():
        m.check_in_sync(m.plan(step))

    dist.barrier()
    t_plan = timed(lambda: m.plan(step), args.iters)
    t_digest = timed(lambda: (plan_digest(plan), m.state_digest()), args.iters)
    dist.barrier()
    t_checked = timed(plan_and_check, args.iters)
    line = (f"rank {rank}/{world}: plan {t_plan:.3f} ms, digests {t_digest:.3f} ms, "
            f"plan + check_in_sync {t_checked:.3f} ms ({len(plan.host) // 4} plan ints)")
    lines = [None] * world
    dist.all_gather_object(lines, line)
    if rank == 0:
        print(f"batch {args.batch}, window {args.window}, backend {dist.get_backend()}, {args.iters} iterations")
        print("\n".join(lines))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
