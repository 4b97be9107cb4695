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
spends its steps past eviction. With two lengths or more, a row `a..b` gives the rate of the tokens
between two of them (`(b - a) / (t_b - t_a)`): decode alone, the prompt and the first steps taken out.
`--concurrent` runs each length with that many requests at once too (distinct 16-token prompts; their
tokens together over the batch's time). `--fresh` builds each engine of each round in a process of its
own (the engines still take turns), so no engine inherits another's heap or threads.
`--prefill N` times a prompt of `N` tokens besides (one token generated; prompt tokens/s, the prompt
its own in each round so no prefix cache serves it).
Printed: tokens/s per round, and each engine's median against the first engine's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
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


def run_engine(model: str, name: str, sink: int, window: int, lengths: list, concurrent: list,
               prefill: int = 0, seed: int = 0) -> dict:
    """`{(n, c): (seconds, tokens)}` of one engine built afresh: `c` requests of `n` tokens each, for every pair;
    with `prefill`, `("prefill", 1)` too: one prompt of that many tokens (drawn with `seed`) to its first token."""
    from vllm import LLM, SamplingParams

    llm = LLM(model, **engine_args(name, sink, window, max(16 + max(lengths), prefill) + 1))
    own = request_args(name, sink, window)
    prompts = [{"prompt_token_ids": list(range(100 + 16 * i, 116 + 16 * i))} for i in range(max(concurrent))]
    warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False, **own)
    llm.generate(prompts[:1], warm, use_tqdm=False)
    out = {}
    for c in concurrent:
        for n in lengths:
            sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False, **own)
            start = time.perf_counter()
            llm.generate(prompts[:c], sp, use_tqdm=False)
            out[n, c] = (time.perf_counter() - start, n * c)
            print(f"{name:>10} {c:>3} x {n:>5} tokens: {n * c / out[n, c][0]:7.1f} tokens/s", flush=True)
    if prefill:
        import random

        rng = random.Random(seed)
        prompt = {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(prefill)]}
        sp = SamplingParams(max_tokens=1, temperature=0, detokenize=False, **own)
        start = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        out["prefill", 1] = (time.perf_counter() - start, prefill)
        print(f"{name:>10} prefill {prefill} tokens: {prefill / out['prefill', 1][0]:7.1f} tokens/s", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a transformers folder with safetensors and config")
    ap.add_argument("--generate", type=int, nargs="+", default=[200, 1500], help="tokens to decode per run")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(BASE[:4]))
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=252)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrent", type=int, nargs="+", default=[1], help="requests at once")
    ap.add_argument("--fresh", action="store_true", help="each engine of each round in a process of its own")
    ap.add_argument("--prefill", type=int, default=0, help="also time a prompt of this many tokens")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # one engine's run, its figures printed as JSON
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    lengths = sorted(a.generate)
    if a.child:
        got = run_engine(a.model, a.child, a.sink, a.window, lengths, a.concurrent, a.prefill, a.round)
        print("RESULT " + json.dumps([[n, c, t, k] for (n, c), (t, k) in got.items()]), flush=True)
        return

    times = {}
    for round_ in range(a.rounds):
        for name in a.engines:
            if a.fresh:
                cmd = [sys.executable, "-m", "benchmarks.vllm_speed", "--model", a.model, "--child", name,
                       "--sink", str(a.sink), "--window", str(a.window), "--generate", *map(str, lengths),
                       "--concurrent", *map(str, a.concurrent), "--prefill", str(a.prefill),
                       "--round", str(round_)]
                text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                line = next(x for x in text.splitlines() if x.startswith("RESULT "))
                got = {(n, c): (t, k) for n, c, t, k in json.loads(line[len("RESULT "):])}
                for (n, c), (t, k) in got.items():
                    print(f"{name:>10} {c:>3} x {n:>5} tokens: {k / t:7.1f} tokens/s", flush=True)
            else:
                got = run_engine(a.model, name, a.sink, a.window, lengths, a.concurrent, a.prefill, round_)
            for key, value in got.items():
                times.setdefault((name,) + key, []).append(value)

    def rates(name, c, n0, n1):  # per round: tokens/s of lengths n1 (n0 None) or of the tokens between n0 and n1
        out = []
        for (t1, k1), *before in zip(times[name, n1, c], *([times[name, n0, c]] if n0 else [])):
            t0, k0 = before[0] if before else (0.0, 0)
            out.append((k1 - k0) / (t1 - t0))
        return out

    base = a.engines[0]
    print(f"\nsink {a.sink} + window {a.window}; median tokens/s over {a.rounds} rounds (ratio to {base})"
          + ("; each engine in a fresh process" if a.fresh else ""))
    print("| requests | tokens | " + " | ".join(a.engines) + " |")
    print("|---|---|" + "---|" * len(a.engines))
    spans = [(None, n) for n in lengths] + list(zip(lengths[:-1], lengths[1:]))
    for c in a.concurrent:
        for n0, n1 in spans:
            ref = statistics.median(rates(base, c, n0, n1))
            cells = [f"{statistics.median(rates(e, c, n0, n1)):.1f} ({statistics.median(rates(e, c, n0, n1)) / ref:.2f}x)"
                     for e in a.engines]
            print(f"| {c} | {n1 if n0 is None else f'{n0}..{n1}'} | " + " | ".join(cells) + " |")
    if a.prefill:
        ref = statistics.median(rates(base, 1, None, "prefill"))
        cells = [f"{statistics.median(rates(e, 1, None, 'prefill')):.1f} "
                 f"({statistics.median(rates(e, 1, None, 'prefill')) / ref:.2f}x)" for e in a.engines]
        print(f"| 1 | prefill {a.prefill} (prompt tokens/s) | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
