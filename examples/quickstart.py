"""flexkv in one page: four chat streams decode far past their window in a fixed-size cache.

    python examples/quickstart.py

Each request keeps 4 attention sinks and a window of 60 tokens. A two-layer
step (random q, k, v stand in for a model's projections) is compiled once
and reused as streams advance, requests finish and new ones take their
slots. At the end the cached outputs are compared with a dense reference
that keeps every token.
"""

import time

import torch

from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.reference import ReferenceCache

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 2, 2, 4, 32
config = BoundedKVConfig(
    num_layers=LAYERS,
    num_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    rows_per_request=1,
    max_source_len=0,
    max_sources=0,
    retention=SinkWindow(sink=4, window=60),
    max_slots=4,
)
cache = BoundedKVManager(config, "cpu")


@torch.compile(fullgraph=True)
def decode_step(qs, ks, vs, plan):
    """One model step: every layer writes its token and attends through the cache."""
    return [cache.attend(layer, qs[layer], ks[layer], vs[layer], plan) for layer in range(LAYERS)]


def main(steps: int = 300, check_from: int = 280):
    torch.manual_seed(0)
    reference = ReferenceCache(config)
    written = {f"chat{i}": 0 for i in range(4)}
    next_id = 4
    worst, cache_time = 0.0, 0.0
    for step_no in range(steps):
        if step_no and step_no % 120 == 0:  # one chat ends, a new one takes its slot
            done = sorted(written)[0]
            cache.remove_request(done)
            reference.remove_request(done)
            del written[done]
            written[f"chat{next_id}"] = 0
            next_id += 1
        rids = sorted(written)
        step = BoundedKVStep(
            tuple(Segment(r, 1) for r in rids), {r: StreamPosition(0, written[r]) for r in rids}
        )
        qs = [torch.randn(4, Q_HEADS, 1, HEAD_DIM) for _ in range(LAYERS)]
        ks = [torch.randn(4, KV_HEADS, 1, HEAD_DIM) for _ in range(LAYERS)]
        vs = [torch.randn(4, KV_HEADS, 1, HEAD_DIM) for _ in range(LAYERS)]
        t0 = time.perf_counter()
        cache.admit(step)
        plan = cache.plan(step)
        outs = decode_step(qs, ks, vs, plan)
        cache.commit(step)
        if step_no:  # the first step compiles
            cache_time += time.perf_counter() - t0
        for layer in range(LAYERS):
            expected = reference.attend(layer, qs[layer], ks[layer], vs[layer], step)
            if step_no >= check_from:
                worst = max(worst, (outs[layer].double() - expected).abs().max().item())
        reference.commit(step)
        for r in rids:
            written[r] += 1
    longest = max(written.values())
    print(f"{steps} steps; the cache's own work (admit, plan, attend, commit) ran "
          f"{4 * (steps - 1) / cache_time:.0f} tokens/s after compile")
    print(f"longest stream {longest} tokens; the cache keeps at most {config.max_retained} per request")
    print(f"cache memory {cache.memory_bytes / 1024:.0f} KiB, fixed; per request {cache.slot_bytes / 1024:.0f} KiB")
    print(f"max |flexkv - dense reference| over the last {steps - check_from} steps: {worst:.2e}")
    return worst


if __name__ == "__main__":
    main()
