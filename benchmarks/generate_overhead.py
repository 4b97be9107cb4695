"""Eager greedy `generate()` through `FlexKVCache` against transformers' own `DynamicCache`, side by side.

A Llama built from its config (random weights, float32, 2 layers, 4 query
and 2 KV heads, hidden 64 or 256) generates `--tokens` tokens greedily
after a 16-token prompt, one stream: once with
`FlexKVCache(model, SinkWindow(4, --window))` and once with a
`DynamicCache` (the model's own growing cache, eager SDPA attention), each
run timed whole, the two interleaved `--repeats` times in one process
(medians). At these sizes the model's arithmetic is small, so the ratio
is mostly per-token host overhead: flexkv's hooks, planning, positions and
mask handling against transformers' own cache bookkeeping. `--compiled`
adds a third column: the same FlexKVCache run with `model.forward`
compiled (`fullgraph=True`), timed after a warm-up run that compiles.
Each run's CPU time (this thread's) is printed beside its wall time: on a
machine shared with other work, wall time also counts the time the thread
waited for a core, and the CPU seconds move less from run to run.

    python -m benchmarks.generate_overhead --threads 1
    python -m benchmarks.generate_overhead --threads 1 --compiled
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

PROMPT = 16


def tiny_llama(hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=8192, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def run(model, cache, ids, tokens: int) -> tuple:
    """One timed `generate()`: `(wall seconds, this thread's CPU seconds)`."""
    t0, c0 = time.perf_counter(), time.thread_time()
    with torch.no_grad():
        out = model.generate(ids, cache=cache, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    elapsed, cpu = time.perf_counter() - t0, time.thread_time() - c0
    assert out.shape[1] == PROMPT + tokens
    return elapsed, cpu


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--hidden", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compiled", action="store_true", help="also time FlexKVCache with model.forward compiled")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import DynamicCache

    from flexkv import SinkWindow
    from flexkv.integrations.transformers import FlexKVCache

    print(f"greedy generate() of {a.tokens} tokens after a {PROMPT}-token prompt, one stream, float32, "
          f"flexkv SinkWindow(4, {a.window}); medians of {a.repeats} interleaved runs; torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"{'hidden':>6} | {'DynamicCache':>12} | {'FlexKVCache':>11} | {'ratio':>5} | {'per token':>9} | "
          f"{'CPU s':>13} | {'CPU ratio':>9}" + (f" | {'compiled':>8} | {'ratio':>5}" if a.compiled else ""))
    for hidden in a.hidden:
        model = tiny_llama(hidden)
        ids = torch.randint(1, 256, (1, PROMPT), generator=torch.Generator().manual_seed(1))

        def flex():
            return run(model, FlexKVCache(model, SinkWindow(4, a.window), max_streams=1), ids, a.tokens)

        def dyn():
            return run(model, DynamicCache(config=model.config), ids, a.tokens)

        runs = {"dyn": [], "flex": [], "compiled": []}
        flex(), dyn()  # warm-up
        for _ in range(a.repeats):
            runs["dyn"].append(dyn())
            runs["flex"].append(flex())
        if a.compiled:
            eager_forward = model.forward
            compiled = torch.compile(eager_forward, fullgraph=True, dynamic=False)
            model.forward = compiled
            flex()  # compiles the prefill and the decode graphs
            for _ in range(a.repeats):
                model.forward = compiled
                runs["compiled"].append(flex())
                model.forward = eager_forward
                runs["dyn"].append(dyn())  # interleaved with the compiled runs too
            model.forward = eager_forward
        (d, dc), (f, fc) = ((statistics.median(r[0] for r in runs[k]), statistics.median(r[1] for r in runs[k]))
                            for k in ("dyn", "flex"))
        line = (f"{hidden:>6} | {d:>10.2f} s | {f:>9.2f} s | {f / d:>4.2f}x | {(f - d) / a.tokens * 1e3:>+6.3f} ms | "
                f"{dc:>5.2f} / {fc:>5.2f} | {fc / dc:>8.2f}x")
        if a.compiled:
            c = statistics.median(r[0] for r in runs["compiled"])
            line += f" | {c:>6.2f} s | {c / d:>4.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
