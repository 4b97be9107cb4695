"""Concurrent streams and tokens/s of vLLM's CPU build, stock against flexkv's plugin, one fixed pool.

One engine per run (run it twice, `--mode stock` and `--mode flexkv`), in this process, on a
random-init two-layer Llama (`--model` to give a saved transformers folder instead). `--streams`
requests of a 16-token prompt each generate up to `--tokens` tokens in all, greedy, against a pool
of `--blocks` blocks of 32 tokens. Printed: the most requests vLLM ran at once, how many finished,
vLLM's preemptions, the wall time and generated tokens per second.

    python -m benchmarks.vllm_streams --mode stock --streams 16 --tokens 2000 --blocks 252
    python -m benchmarks.vllm_streams --mode flexkv --streams 16 --tokens 2000 --blocks 252 --window 124

Needs the `vllm` extra's environment (docs/vllm.md).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def random_llama(path: str) -> str:
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536,
                                   tie_word_embeddings=False, initializer_range=0.3)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("stock", "flexkv"), required=True)
    ap.add_argument("--model", default=None, help="a transformers folder (default: a random-init Llama)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2000, help="prompt + generated tokens per stream")
    ap.add_argument("--blocks", type=int, default=252, help="blocks of 32 tokens in the KV pool")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=124)
    ap.add_argument("--batched-tokens", type=int, default=128, help="vLLM's max_num_batched_tokens")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    model = args.model or random_llama(tempfile.mkdtemp(prefix="flexkv-llama-"))
    extra = {"additional_config": {"flexkv": {"sink": args.sink, "window": args.window}}} if args.mode == "flexkv" else {}
    llm = LLM(model, skip_tokenizer_init=args.model is None, enable_prefix_caching=False, block_size=32,
              dtype="float32", max_model_len=args.tokens + 32, enforce_eager=True, num_gpu_blocks_override=args.blocks,
              max_num_batched_tokens=args.batched_tokens, max_num_seqs=min(args.batched_tokens, 256), seed=0, **extra)
    peak, preempted = [0], [0]
    schedule, preempt = Scheduler.schedule, Scheduler._preempt_request

    def counting_schedule(self, *a, **k):
        out = schedule(self, *a, **k)
        peak[0] = max(peak[0], len(self.running))
        return out

    def counting_preempt(self, *a, **k):
        preempted[0] += 1
        return preempt(self, *a, **k)

    Scheduler.schedule, Scheduler._preempt_request = counting_schedule, counting_preempt
    prompt = 16
    sp = SamplingParams(max_tokens=args.tokens - prompt, temperature=0, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": [(7 * i + k) % 500 + 3 for k in range(prompt)]} for i in range(args.streams)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    done = sum(len(o.outputs[0].token_ids) == args.tokens - prompt for o in outs)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"mode={args.mode} streams={args.streams} tokens={args.tokens} blocks={args.blocks} "
          f"sink={args.sink} window={args.window}: ran at once {peak[0]}, finished {done}, "
          f"preemptions {preempted[0]}, {wall:.1f} s, {generated / wall:.1f} generated tokens/s")


if __name__ == "__main__":
    main()
