"""Tensor-parallel streaming decode with flexkv.

Run with:

    torchrun --nproc_per_node 2 examples/tp_streaming.py [--steps 64] [--compile] [--check] [--check-plans]

or as a plain script, `python examples/tp_streaming.py [...]`, which starts
`--nproc` (default 2) local processes over gloo itself.

A toy attention stack (no MLPs) is split Megatron-style over the ranks of the
job: each rank computes the queries, keys and values of its own heads
(column-parallel projections), attends over its share of the KV cache, and
the ranks sum their partial outputs after the row-parallel output projection
(one all-reduce per layer: the model's communication). The cache is built
through `BoundedKVResource` with the process group in `EngineResourceInfo`,
so each rank holds `num_heads / world_size` KV heads of every slot and of the
shared prompt. Every rank runs the same deterministic scheduler, so every
rank admits, plans and removes the same requests in the same order and the
cache needs no communication at all.

`--check` also runs the whole model on rank 0 with every head in one plain
cache and prints the largest difference. `--check-plans` compares every plan
across ranks (one tiny all-gather per step; a debugging aid).
On CUDA machines the job uses NCCL and one GPU per rank; on CPU it uses gloo.
"""

from __future__ import annotations

import argparse
import os
import random
import time
import warnings

import torch
import torch.distributed as dist

from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.serving import BoundedKVResource, BoundedKVSpec, EngineResourceInfo
from flexkv.serving.distributed import HeadShard

LAYERS, KV_HEADS, QUERY_HEADS, HEAD_DIM, VOCAB = 4, 4, 8, 32, 1000
HIDDEN = QUERY_HEADS * HEAD_DIM
PROMPT_LEN = 24  # a shared system prompt, registered once as a source


class Weights:
    """The model's full weights, drawn from one seed so that every rank draws the same ones."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        s = HIDDEN ** -0.5
        self.embed = torch.randn(VOCAB, HIDDEN, generator=g)
        self.layers = [
            dict(
                q=torch.randn(HIDDEN, QUERY_HEADS * HEAD_DIM, generator=g) * s,
                k=torch.randn(HIDDEN, KV_HEADS * HEAD_DIM, generator=g) * s,
                v=torch.randn(HIDDEN, KV_HEADS * HEAD_DIM, generator=g) * s,
                o=torch.randn(QUERY_HEADS * HEAD_DIM, HIDDEN, generator=g) * s,
            )
            for _ in range(LAYERS)
        ]
        # The prompt's keys and values for every head: [layers, rows=1, KV_HEADS, PROMPT_LEN, HEAD_DIM].
        self.prompt_k = torch.randn(LAYERS, 1, KV_HEADS, PROMPT_LEN, HEAD_DIM, generator=g)
        self.prompt_v = torch.randn(LAYERS, 1, KV_HEADS, PROMPT_LEN, HEAD_DIM, generator=g)


class TPAttentionStack:
    """This rank's slice of every layer: columns of W_q/W_k/W_v and rows of W_o for its heads."""

    def __init__(self, weights: Weights, shard: HeadShard, cache, device, group=None):
        qs, ks = shard.query_slice(QUERY_HEADS), shard.kv_slice
        cols_q = slice(qs.start * HEAD_DIM, qs.stop * HEAD_DIM)
        cols_kv = slice(ks.start * HEAD_DIM, ks.stop * HEAD_DIM)
        self.hq = qs.stop - qs.start
        self.h = ks.stop - ks.start
        self.embed = weights.embed.to(device)
        self.layers = [
            dict(q=w["q"][:, cols_q].contiguous().to(device), k=w["k"][:, cols_kv].contiguous().to(device),
                 v=w["v"][:, cols_kv].contiguous().to(device), o=w["o"][cols_q].contiguous().to(device))
            for w in weights.layers
        ]
        self.cache = cache
        self.group = group

    def __call__(self, tokens: torch.Tensor, plan) -> torch.Tensor:
        """`tokens [N, T]` -> hidden states `[N, T, HIDDEN]`; the same on every rank."""
        x = self.embed[tokens]
        N, T, _ = x.shape
        for i, w in enumerate(self.layers):
            # The softmax scale is folded into q; besides saving a multiply, this makes q a buffer of
            # its own: compiled FlexAttention on the CPU failed to lower a q that is only a view of the
            # projection's output (torch 2.13).
            q = (x @ w["q"]).view(N, T, self.hq, HEAD_DIM).transpose(1, 2) * HEAD_DIM ** -0.5
            k = (x @ w["k"]).view(N, T, self.h, HEAD_DIM).transpose(1, 2)
            v = (x @ w["v"]).view(N, T, self.h, HEAD_DIM).transpose(1, 2)
            o = self.cache.attend(i, q, k, v, plan, scale=1.0)  # [N, hq, T, D]: this rank's heads only
            y = o.transpose(1, 2).reshape(N, T, self.hq * HEAD_DIM) @ w["o"]
            if self.group is not None:
                dist.all_reduce(y, group=self.group)  # the model's communication, not the cache's
            x = x + y
        return x


def scheduler(seed: int, steps: int, batch: int, slots: int):
    """A deterministic stream of (removals, step, tokens): requests arrive, decode and finish."""
    rng = random.Random(seed)
    live: dict = {}  # rid -> [uses_prompt, written, remaining]
    ran: set = set()
    counter = 0
    for _ in range(steps):
        removals = [rid for rid, r in live.items() if r[2] == 0 and rid in ran]
        for rid in removals:
            del live[rid]
        while len(live) < slots and rng.random() < 0.5:
            live[f"req{counter}"] = [rng.random() < 0.5, 0, rng.randint(8, 80)]
            counter += 1
        running = [rid for rid, r in live.items() if r[2] > 0][:batch]
        segs = [Segment(rid, 1) for rid in running] + [Segment(None, 0)] * (batch - len(running))
        positions = {rid: StreamPosition(PROMPT_LEN if live[rid][0] else 0, live[rid][1]) for rid in running}
        tokens = [[rng.randrange(VOCAB)] for _ in segs]
        for rid in running:
            live[rid][1] += 1
            live[rid][2] -= 1
            ran.add(rid)
        yield removals, BoundedKVStep(tuple(segs), positions), tokens


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="local processes to start when not run under torchrun")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--compile", action="store_true", help="run each step as one torch.compile'd graph")
    ap.add_argument("--check", action="store_true", help="compare with a single-process model on rank 0")
    ap.add_argument("--check-plans", action="store_true", help="compare plans across ranks every step")
    return ap


def main(argv=None, force_gloo: bool = False):
    args = parser().parse_args(argv)
    use_cuda = torch.cuda.is_available() and not force_gloo
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if use_cuda else "gloo")
    group = dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")

    config = BoundedKVConfig(
        LAYERS, KV_HEADS, HEAD_DIM, rows_per_request=1, max_source_len=PROMPT_LEN,
        retention=SinkWindow(sink=4, window=64), max_slots=2 * args.batch, dtype=None,
    )
    spec = BoundedKVSpec("attention", config=config)
    cache = BoundedKVResource().build(spec, EngineResourceInfo(device, torch.float32, process_group=group))
    cache.check_plans = args.check_plans
    weights = Weights()
    cache.add_source(weights.prompt_k.to(device), weights.prompt_v.to(device))  # full heads: keeps its slice
    model = TPAttentionStack(weights, cache.shard, cache, device, group)

    single = None
    if args.check and rank == 0:
        whole = BoundedKVManager(config.replace(dtype=torch.float32), device)
        whole.add_source(weights.prompt_k.to(device), weights.prompt_v.to(device))
        single = TPAttentionStack(weights, HeadShard(KV_HEADS, 0, 1), whole, device)

    if not args.compile:  # eager FlexAttention is expected here; say so once instead of warning per rank
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    fwd = torch.compile(model.__call__, fullgraph=True) if args.compile else model
    ref_fwd = None
    if single is not None:
        ref_fwd = torch.compile(single.__call__, fullgraph=True) if args.compile else single

    plan_s = step_s = 0.0
    worst = 0.0
    timed = 0
    served, finished = set(), 0
    for i, (removals, step, tokens) in enumerate(scheduler(1, args.steps, args.batch, config.max_slots)):
        for rid in removals:
            cache.remove_request(rid)
        finished += len(removals)
        served.update(seg.request_id for seg in step.segments if seg.request_id is not None)
        t0 = time.perf_counter()
        cache.admit(step)
        plan = cache.plan(step)
        t1 = time.perf_counter()
        tok = torch.tensor(tokens, device=device)
        x = fwd(tok, plan)
        if use_cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        cache.commit(step)
        if i >= 4:  # leave out warm-up (and compilation)
            plan_s += t1 - t0
            step_s += t2 - t1
            timed += 1
        if single is not None:
            for rid in removals:
                single.cache.remove_request(rid)
            single.cache.admit(step)
            x_ref = ref_fwd(tok, single.cache.plan(step))
            single.cache.commit(step)
            worst = max(worst, (x - x_ref).abs().max().item())

    s = cache.shard
    mib = 1 << 20
    line = (
        f"rank {rank}/{world}: KV heads {s.kv_slice.start}..{s.kv_slice.stop - 1}, "
        f"query heads {s.query_slice(QUERY_HEADS).start}..{s.query_slice(QUERY_HEADS).stop - 1}, "
        f"cache {cache.memory_bytes / mib:.2f} MiB of {cache.memory_bytes * world / mib:.2f} MiB, "
        f"plan {1e3 * plan_s / max(timed, 1):.3f} ms/step, model step {1e3 * step_s / max(timed, 1):.2f} ms/step"
    )
    if args.compile:
        from torch._dynamo.utils import counters

        line += f", graphs compiled {counters['stats']['unique_graphs']}"
    lines = [None] * world
    dist.all_gather_object(lines, line, group=group)
    if rank == 0:
        print(f"{args.steps} decode steps, batch {args.batch}, {len(served)} requests ({finished} finished and "
              f"removed), backend {dist.get_backend(group)}, {'compiled' if args.compile else 'eager FlexAttention'}; "
              f"cache communication per step: none (the model all-reduces once per layer)")
        for text in lines:
            print(text)
        if single is not None:
            print(f"check: max |tensor-parallel - single-process| over all steps = {worst:.3g}")
        if args.check or args.check_plans:
            print("(timings include the checks: --check-plans waits for the slowest rank every step)")
    dist.destroy_process_group()


def _local_rank(rank: int, world: int, port: int, argv) -> None:
    """One of the processes a plain `python examples/tp_streaming.py` starts (what torchrun would set up)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    main(argv, force_gloo=True)


def run_locally(argv=None) -> None:
    """Start `--nproc` processes on this machine (gloo over loopback), each running `main`."""
    import socket
    import sys

    import torch.multiprocessing as mp

    argv = sys.argv[1:] if argv is None else argv
    nproc = parser().parse_args(argv).nproc
    if nproc < 1:
        raise SystemExit(f"--nproc must be >= 1, got {nproc}")
    with socket.socket() as sock:  # a free port on the loopback interface for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    print(f"no RANK in the environment: starting {nproc} local processes over gloo "
          f"(under torchrun: torchrun --nproc_per_node {nproc} examples/tp_streaming.py)", flush=True)
    mp.spawn(_local_rank, args=(nproc, port, argv), nprocs=nproc, join=True)


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
    else:
        run_locally()
