"""Greedy decode tokens/s in vLLM's CPU build: flexkv's plugin against stock vLLM, one process, interleaved.

    VLLM_CPU_KVCACHE_SPACE=2 python -m benchmarks.vllm_speed --model FOLDER --generate 200 1500 --rounds 2

For each `--generate` length, every engine in `--engines` decodes that many tokens after a 16-token
prompt, `--rounds` times, the engines taking turns (each round builds each engine afresh, runs one
untimed warm-up request, then the timed one). Engines:

- `stock`: vLLM dense;
- `sliding`: vLLM with every layer a plain sliding window over `sink + window + 1` keys
  (`hf_overrides={"sliding_window": ...}`): the same memory bound as the plugin, on vLLM's kernel;
- `cache`, `stream`: the plugin, sink + window, in-cache / stream positions;
- `own`: the plugin started with twice the window, each request asking for sink + window of its own
  (`extra_args`, in-cache positions): what a request's own retention costs against `cache`.

Each name with `+pc` appended (`stock+pc`, `cache+pc`, ...) is the same engine with vLLM's prefix caching
on, as `vllm serve` starts by default; without it, prefix caching is off.

A length at most `sink + window + 1 - 16` stays inside the window (nothing evicted); a longer one
spends its steps past eviction. Printed: tokens/s per round, and each engine's median against the
first engine's.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

BASE = ("stock", "sliding", "cache", "stream", "own")
ENGINES = BASE + tuple(f"{name}+pc" for name in BASE)


def engine_args(name: str, sink: int, window: int, max_len: int) -> dict:
    name, _, caching = name.partition("+")
    kw = dict(skip_tokenizer_init=True, enable_prefix_caching=caching == "pc", block_size=32, dtype="float32",
              enforce_eager=True, seed=0, max_model_len=max_len)
    if name == "sliding":
        kw["hf_overrides"] = {"sliding_window": sink + window + 1}
    elif name in ("cache", "stream"):
        kw["additional_config"] = {"flexkv": {"sink": sink, "window": window, "positions": name}}
    elif name == "own":
        kw["additional_config"] = {"flexkv": {"sink": sink, "window": 2 * window, "positions": "cache"}}
    return kw


def request_args(name: str, sink: int, window: int) -> dict:
    """What each request of engine `name` asks for beyond its length: `own` narrows the engine's retention."""
    return {"extra_args": {"flexkv": {"sink": sink, "window": window}}} if name.partition("+")[0] == "own" else {}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a transformers folder with safetensors and config")
    ap.add_argument("--generate", type=int, nargs="+", default=[200, 1500], help="tokens to decode per run")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(BASE[:4]))
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=252)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    from vllm import LLM, SamplingParams

    prompt = list(range(100, 116))
    rates = {(n, e): [] for n in a.generate for e in a.engines}
    for _ in range(a.rounds):
        for name in a.engines:
            llm = LLM(a.model, **engine_args(name, a.sink, a.window, 16 + max(a.generate) + 1))
            own = request_args(name, a.sink, a.window)
            warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False, **own)
            llm.generate([{"prompt_token_ids": prompt}], warm, use_tqdm=False)
            for n in a.generate:
                sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False, **own)
                start = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
                rates[n, name].append(n / (time.perf_counter() - start))
                print(f"{name:>8} {n:>6} tokens: {rates[n, name][-1]:7.1f} tokens/s", flush=True)
            del llm
    base = a.engines[0]
    print(f"\nsink {a.sink} + window {a.window}; median tokens/s over {a.rounds} rounds (ratio to {base})")
    print("| tokens | " + " | ".join(a.engines) + " |")
    print("|---|" + "---|" * len(a.engines))
    for n in a.generate:
        ref = statistics.median(rates[n, base])
        cells = [f"{statistics.median(rates[n, e]):.1f} ({statistics.median(rates[n, e]) / ref:.2f}x)"
                 for e in a.engines]
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
