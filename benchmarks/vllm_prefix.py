"""Many requests sharing one long system prompt, through vLLM's CPU build: prefix-cache hits, blocks held, time.

    VLLM_CPU_KVCACHE_SPACE=2 python -m benchmarks.vllm_prefix --model FOLDER --system 2000 --requests 16

Every request is the same `--system`-token prompt followed by a short request of its own
(`--user` tokens), and generates `--generate` tokens greedily; they are submitted together. Engines
(one process, built afresh in turn):

- `flexkv+pc`: the plugin (sink + window, in-cache positions) with vLLM's prefix caching on (its default);
- `flexkv`: the plugin with prefix caching off;
- `stock+pc`: vLLM dense with prefix caching on.

Printed per engine: prompt tokens served from the prefix cache (vLLM's `num_cached_tokens`, summed,
against all prompt tokens), the most blocks the engine held at once (the pool's size less its fewest
free blocks, counting cached blocks no request holds as free, as vLLM does), seconds for the whole
batch, and whether each request's greedy ids equal those of the first engine.
"""

import argparse
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its pool is readable

ENGINES = ("flexkv+pc", "flexkv", "stock+pc")


def engine_args(name: str, sink: int, window: int, max_len: int) -> dict:
    kw = dict(skip_tokenizer_init=True, enable_prefix_caching=name.endswith("+pc"), block_size=32,
              dtype="float32", enforce_eager=True, seed=0, max_model_len=max_len)
    if name.startswith("flexkv"):
        kw["additional_config"] = {"flexkv": {"sink": sink, "window": window}}
    return kw


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a transformers folder with safetensors and config")
    ap.add_argument("--system", type=int, default=2000, help="tokens of the shared system prompt")
    ap.add_argument("--user", type=int, default=24, help="tokens of each request's own part")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--generate", type=int, default=32)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=252)
    ap.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    a = ap.parse_args()
    import torch
    from vllm import LLM, SamplingParams
    from vllm.v1.core.block_pool import BlockPool

    g = torch.Generator().manual_seed(0)
    system = torch.randint(100, 20000, (a.system,), generator=g).tolist()
    prompts = [system + torch.randint(100, 20000, (a.user,), generator=g).tolist() for _ in range(a.requests)]
    sp = SamplingParams(max_tokens=a.generate, temperature=0, ignore_eos=True, detokenize=False)
    fewest = {}
    own = BlockPool.get_new_blocks

    def get_new_blocks(self, n):
        out = own(self, n)
        fewest[id(self)] = min(fewest.get(id(self), 1 << 62), self.get_num_free_blocks())
        return out

    BlockPool.get_new_blocks = get_new_blocks
    first, rows = None, []
    for name in a.engines:
        llm = LLM(a.model, **engine_args(name, a.sink, a.window, a.system + a.user + a.generate + 1))
        pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
        fewest.pop(id(pool), None)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        took = time.perf_counter() - start
        ids = [list(o.outputs[0].token_ids) for o in outs]
        first = first or ids
        cached = sum(o.num_cached_tokens or 0 for o in outs)
        held = pool.num_gpu_blocks - 1 - fewest.get(id(pool), pool.num_gpu_blocks - 1)
        same = sum(x == y for x, y in zip(ids, first))
        rows.append((name, cached, held, took, same))
        print(f"{name:>10}: {cached} of {len(prompts) * len(prompts[0])} prompt tokens from the prefix cache, "
              f"{held} blocks held at most, {took:.1f} s, {same}/{len(ids)} equal to {a.engines[0]}", flush=True)
        del llm
    print(f"\n{a.requests} requests: a {a.system}-token system prompt + {a.user} tokens each, {a.generate} "
          f"generated; sink {a.sink} + window {a.window}, blocks of 32 tokens")
    print("| engine | prompt tokens from the prefix cache | blocks held at most | seconds | ids equal |")
    print("|---|---|---|---|---|")
    total = len(prompts) * len(prompts[0])
    for name, cached, held, took, same in rows:
        print(f"| {name} | {cached} / {total} ({cached / total:.0%}) | {held} | {took:.1f} | {same}/{len(prompts)} |")


if __name__ == "__main__":
    main()
