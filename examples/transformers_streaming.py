"""Stream a long greedy generation through flexkv inside a transformers model.

A randomly initialised Llama-family model is built from a config (nothing is
downloaded), a batch of prompts of different lengths is prefilled through a
`FlexKVCache`, and the decode step runs compiled (`model.forward` wrapped in
`torch.compile`; the flexkv planning hooks stay outside the graph). Every
`--report` tokens it prints the decode speed and the memory the cache holds,
next to what transformers' `DynamicCache` would hold for the same history.
With `--baseline` it then runs the same decode with a `DynamicCache` for
comparison.

    PYTHONPATH=. python examples/transformers_streaming.py --tokens 2048
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from flexkv import SinkWindow
from flexkv.integrations.transformers import FlexKVCache


def mib(n: int) -> str:
    return f"{n / 2**20:8.2f} MiB"


def build_model(args) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=1 << 20,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    return LlamaForCausalLM(cfg).eval()


def prompts(args):
    g = torch.Generator().manual_seed(1)
    lengths = [args.prompt - 7 * i for i in range(args.batch)]
    T = max(lengths)
    ids = torch.zeros(args.batch, T, dtype=torch.long)
    mask = torch.zeros(args.batch, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, T - n:] = torch.randint(1, args.vocab, (n,), generator=g)
        mask[b, T - n:] = 1
    return ids, mask, lengths


def rate(step_seconds, batch: int) -> str:
    """Tokens/s from the median step time (robust to other load on the machine) and the mean."""
    med = sorted(step_seconds)[len(step_seconds) // 2]
    mean = sum(step_seconds) / len(step_seconds)
    return f"{batch / med:8.1f} tokens/s at the median step ({1e3 * med:.1f} ms), {batch / mean:8.1f} at the mean"


def dynamic_bytes(model, batch: int, length: int) -> int:
    """What a DynamicCache holds for `batch` rows of `length` tokens: keys and values of every layer."""
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return 2 * c.num_hidden_layers * batch * c.num_key_value_heads * length * head_dim * itemsize


def run_flexkv(model, args):
    ids, mask, lengths = prompts(args)
    cache = FlexKVCache(
        model, SinkWindow(args.sink, args.window), max_streams=args.batch, rope_positions=args.rope_positions,
        prefill_chunk=args.chunk,
    )
    print(f"{cache}")
    print(f"flexkv cache memory: {mib(cache.memory_bytes)} for {args.batch} streams "
          f"(sink {args.sink} + window {args.window} tokens each)")
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(input_ids=ids, attention_mask=mask, cache=cache).logits[:, -1]
        print(f"prefill ({max(lengths)} columns, eager): {time.perf_counter() - t0:.2f} s")
        if not args.eager:
            model.forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
        tok = logits.argmax(-1, keepdim=True)
        t0 = time.perf_counter()
        model(input_ids=tok, cache=cache)  # compiles on the first call
        print(f"first decode step (compile): {time.perf_counter() - t0:.1f} s")
        done, steps = 1, []
        t_start = time.perf_counter()
        while done < args.tokens:
            t = time.perf_counter()
            tok = model(input_ids=tok, cache=cache).logits[:, -1].argmax(-1, keepdim=True)
            steps.append(time.perf_counter() - t)
            done += 1
            if done % args.report == 0 or done == args.tokens:
                length = max(lengths) + done
                print(f"  token {done:6d}: {rate(steps[-args.report:], args.batch)}  "
                      f"flexkv {mib(cache.memory_bytes)}  DynamicCache would hold "
                      f"{mib(dynamic_bytes(model, args.batch, length))}")
        wall = (done - 1) * args.batch / (time.perf_counter() - t_start)
    print(f"flexkv decode, {done - 1} steps: {rate(steps, args.batch)}, wall {wall:.1f} tokens/s; "
          f"cache memory {mib(cache.memory_bytes)} throughout")


def run_dynamic(model, args):
    ids, mask, lengths = prompts(args)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, cache=cache)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones(args.batch, 1, dtype=torch.long)], dim=1)
        steps = []
        for i in range(1, args.tokens):
            t = time.perf_counter()
            out = model(input_ids=tok, attention_mask=mask, cache=cache)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones(args.batch, 1, dtype=torch.long)], dim=1)
            steps.append(time.perf_counter() - t)
            if (i + 1) % args.report == 0:
                held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
                print(f"  token {i + 1:6d}: {rate(steps[-args.report:], args.batch)}  DynamicCache {mib(held)}")
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    print(f"DynamicCache (eager SDPA) decode, {len(steps)} steps: {rate(steps, args.batch)}; holds {mib(held)} at the end")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024, help="tokens to generate per stream")
    p.add_argument("--batch", type=int, default=4, help="streams (prompts of different lengths)")
    p.add_argument("--prompt", type=int, default=64, help="longest prompt length")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--window", type=int, default=252)
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk (tokens per flexkv step)")
    p.add_argument("--rope-positions", choices=("stream", "cache"), default="stream",
                   help="rotary position mode of the cache")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--report", type=int, default=256, help="print every this many tokens")
    p.add_argument("--eager", action="store_true", help="do not compile the decode step (slow: eager FlexAttention)")
    p.add_argument("--baseline", action="store_true", help="also decode with a DynamicCache")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    run_flexkv(model, args)
    if args.baseline:
        run_dynamic(build_model(args), args)


if __name__ == "__main__":
    main()
