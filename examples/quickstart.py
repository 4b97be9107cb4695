"""flexkv in one page: chat streams decode far past their window in a fixed-size cache.

    python examples/quickstart.py

A two-layer attention model (random weights) streams through a
`StreamSession`: each request keeps 4 attention sinks and a window of 60
tokens; requests finish and new ones take their lanes; the step is compiled
once. The same model on an `UncachedHistory` (every token kept, attention
over the whole history with the retention mask, float64) runs beside it, and
the outputs are compared at the end.
"""

import time

import torch

from flexkv import BoundedKVConfig, SinkWindow, StreamSession, UncachedHistory

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM, DIM, VOCAB = 2, 2, 4, 32, 64, 256
config = BoundedKVConfig(
    num_layers=LAYERS, num_heads=KV_HEADS, head_dim=HEAD_DIM, rows_per_request=1,
    max_source_len=0, max_sources=0,
    retention=SinkWindow(sink=4, window=60),  # StreamingLLM: 4 sinks + the last 60 tokens
    max_slots=4,
)

g = torch.Generator().manual_seed(0)
embed = torch.randn(VOCAB, DIM, generator=g)
weights = [[torch.randn(DIM, n, generator=g) * DIM ** -0.5 for n in (Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM,
                                                                  KV_HEADS * HEAD_DIM)]
           + [torch.randn(Q_HEADS * HEAD_DIM, DIM, generator=g) * (Q_HEADS * HEAD_DIM) ** -0.5]
           for _ in range(LAYERS)]


def model(attn, tokens):
    """`tokens [B, T]` -> hidden states `[B, T, DIM]`; `attn(layer, q, k, v)` is the cache's attention."""
    x = embed[tokens]
    B, T, _ = x.shape
    for layer, (wq, wk, wv, wo) in enumerate(weights):
        q = (x @ wq).view(B, T, Q_HEADS, HEAD_DIM).transpose(1, 2)   # [B, heads, T, head_dim]; 2-way GQA
        k = (x @ wk).view(B, T, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = (x @ wv).view(B, T, KV_HEADS, HEAD_DIM).transpose(1, 2)
        x = x + attn(layer, q, k, v).transpose(1, 2).reshape(B, T, -1) @ wo
    return x


def main(steps: int = 300, check_from: int = 280):
    session = StreamSession(config)                                   # compiled, padded to 4 lanes
    uncached = StreamSession(UncachedHistory(config), compile=False)  # the same model, nothing evicted
    session.warmup(model, torch.zeros(1, dtype=torch.long))           # compile before the clock starts
    last = {f"chat{i}": i for i in range(4)}                          # each request's last token
    next_id, worst, seconds = 4, 0.0, 0.0
    for step_no in range(steps):
        if step_no and step_no % 120 == 0:  # one chat ends, a new one takes its lane
            done = min(last)
            session.finish(done)
            uncached.finish(done)
            del last[done]
            last[f"chat{next_id}"] = next_id
            next_id += 1
        feeds = {rid: torch.tensor([tok]) for rid, tok in last.items()}
        t0 = time.perf_counter()
        out = session.step(feeds, model)                              # admit, plan, attend, commit
        seconds += time.perf_counter() - t0
        expected = uncached.step(feeds, model)
        for rid in feeds:
            if step_no >= check_from:
                worst = max(worst, (out[rid] - expected[rid]).abs().max().item())
            last[rid] = int(out[rid][-1].sum().abs() * 1000) % VOCAB  # a deterministic next token
    longest = max(session.written(r) for r in last)
    print(f"{steps} steps; the session's step (admit, plan, the compiled model, commit) ran "
          f"{4 * steps / seconds:.0f} tokens/s")
    print(f"longest stream {longest} tokens; the cache keeps at most {config.max_retained} per request")
    cache = session.cache
    print(f"cache memory {cache.memory_bytes / 1024:.0f} KiB, fixed; per request {cache.slot_bytes / 1024:.0f} KiB")
    print(f"max |flexkv - uncached model| over the last {steps - check_from} steps: {worst:.2e}")
    return worst


if __name__ == "__main__":
    main()
