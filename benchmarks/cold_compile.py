"""Compile time, cold and warm, each case in a fresh process.

Every case runs in a child process of its own. **Cold**: the inductor cache
(`TORCHINDUCTOR_CACHE_DIR`) points at a new, empty temporary directory, so
nothing compiled before is reused; **warm**: a second child on the same
directory. For each run the table gives the seconds the compile took (the
first call, or the session's warm-up) and the CPU seconds of the whole child
(its compiler processes included), which moves less than wall time when
other jobs share the machine.

Cases:

- `model-flexkv`: a decode step (4 layers, `--layers` to change) of `flexkv.cli.stream_model.StreamModel`
  (8 streams, 16 query / 8 KV heads x 64, 4 sinks + window 252) on a
  `StreamSession` (the whole model step compiled as one graph);
- `model-ring`: the same model over a ring cache + SDPA per layer, compiled
  as one graph: what the model costs to compile without flexkv;
- `chunk-flexkv`, `chunk-ring`: the same two over a chunk of 50 tokens per step (4 streams,
  the shape of a DiT estimator's chunk), which the CPU serves on the rows path;
- `dit-flexkv`, `dit-ring`: the same two at the shape of a flow-matching DiT's step over a voice
  prompt: 2 requests x 2 classifier-free-guidance rows, chunks of 50 frames inserted in front
  (`reverse_step_order`), the prompt's last 100 frames as the sink (a source of 150) and a window
  of 200; the ring holds each row's copy of those 100 frames beside its window. flexkv reads the
  prompt where it lives, so its rows gather their cells;
- `session-2-buckets`: the flexkv model on a session with two token sizes
  (decode T 1 and chunks of T 16), both compiled at warm-up;
- `flexkv-run`: `flexkv run` (the built-in workload, 20 steps), its reported
  compile time;
- `example-quickstart`, `example-chat`, `example-conformer`, `example-tts`:
  the examples' warm-ups (`StreamSession.warmup`), with short runs.

Run by name only (they need `flexkv[transformers,real]` and SmolLM2, docs/real_model.md): a
trained model's `generate()` (SmolLM2-135M, 30 layers, a 512-token prompt, greedy, 3 new tokens)
compiled the two ways transformers users write it, through `FlexKVCache(model, SinkWindow(4, 252))`
or transformers' `StaticCache` sized for the run:

- `hf-forward-flexkv`, `hf-forward-static`: `model.forward = torch.compile(model.forward,
  fullgraph=True)`, prefill and decode compiled; the time is the prefill's and the first decode
  step's (each printed too, and the second decode step's, compiled: the speed after);
- `hf-config-flexkv`, `hf-config-static`: `generate(compile_config=CompileConfig())`,
  the decode step compiled (prefill eager); the time is the first decode step's.

    python -m benchmarks.cold_compile                      # every case, cold then warm
    python -m benchmarks.cold_compile --cases model-flexkv,model-ring
    python -m benchmarks.cold_compile --cases model-flexkv,model-ring --layers 40
    python -m benchmarks.cold_compile --cases hf-forward-flexkv,hf-forward-static,hf-config-flexkv,hf-config-static
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HF_CASES = ("hf-forward-flexkv", "hf-forward-static", "hf-config-flexkv", "hf-config-static")
CASES = ("model-flexkv", "model-ring", "chunk-flexkv", "chunk-ring", "dit-flexkv", "dit-ring", "session-2-buckets", "flexkv-run", "example-quickstart", "example-chat",
         "example-conformer", "example-tts")


# ------------------------------------------------------------------ child side


def _decode_workload():
    from flexkv.cli.workload import Workload

    layers = int(os.environ.get("FLEXKV_BENCH_LAYERS", "4"))
    return Workload(name="decode", layers=layers, kv_heads=8, q_heads=16, head_dim=64, sink=4, window=252, span=1,
                    requests=8, stream_len=(100, 1000))


def _model_fn(model, layers):
    def fn(attn, x):
        for l in range(layers):
            x = model.layer(l, x, attn)[0]
        return x

    return fn


def _rows_fn(fn, rows: int):
    """`fn` over a session's feed `[B, T, rows, d]`: the model's rows `[B * rows, T, d]` and back."""
    def rows_fn(attn, x):
        B, T = x.shape[:2]
        out = fn(attn, x.transpose(1, 2).reshape(B * rows, T, -1))
        return out.view(B, rows, T, -1).transpose(1, 2)

    return rows_fn


def _child_model(flexkv: bool, token_sizes=(1,), chunk: int = 0, dit: bool = False) -> float:
    import torch
    import torch.nn.functional as F

    from flexkv import BoundedKVManager, StreamSession
    from flexkv.cli.stream_model import StreamModel

    w = _decode_workload()
    if dit:
        w = w.replace(tokens=chunk, span=chunk, requests=2, rows=2, source_len=150, sink=100, window=200,
                      reverse_step_order=True)
        token_sizes = (chunk,)
    elif chunk:
        w = w.replace(tokens=chunk, span=chunk, requests=4)
        token_sizes = (chunk,)
    elif max(token_sizes) > 1:
        w = w.replace(tokens=max(token_sizes), span=max(token_sizes))
    model = StreamModel(w)
    T = w.step_tokens
    N = w.requests * w.rows
    if flexkv:
        session = StreamSession(BoundedKVManager(w.config(), "cpu"), token_sizes=token_sizes)
        return session.warmup(_rows_fn(_model_fn(model, w.layers), w.rows), torch.randn(T, w.rows, w.d_model))
    x = torch.randn(N, T, w.d_model)
    C = w.sink + w.window + T
    K = [torch.zeros(N, w.kv_heads, C, w.head_dim) for _ in range(w.layers)]
    V = [torch.zeros_like(k) for k in K]

    def step(x, cells, mask):
        def attend(l, q, k, v):
            if T == 1:
                K[l][torch.arange(N), :, cells] = k[:, :, 0]
                V[l][torch.arange(N), :, cells] = v[:, :, 0]
                return F.scaled_dot_product_attention(q, K[l], V[l], enable_gqa=True)
            # a chunk: the ring's write of the step's tokens, then the whole ring under a mask
            K[l][:, :, cells] = k
            V[l][:, :, cells] = v
            return F.scaled_dot_product_attention(q, K[l], V[l], attn_mask=mask, enable_gqa=True)

        return _model_fn(model, w.layers)(attend, x)

    cells = torch.arange(N) % C if T == 1 else torch.arange(T) % C
    # Timed from the `torch.compile` call, as flexkv's warm-up is: the first call in a process
    # imports the compiler (about 2.6 s here), which either side pays once.
    t0 = time.perf_counter()
    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    with torch.no_grad():
        compiled(x, cells, torch.zeros(N, 1, T, C))
    return time.perf_counter() - t0


def _child_flexkv_run() -> float:
    out = Path(tempfile.mkdtemp()) / "run.json"
    subprocess.run([sys.executable, "-m", "flexkv", "run", "--steps", "20", "--quiet", "--json", str(out)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["compile_s"]


_EXAMPLE_ARGS = {
    "quickstart": None,
    "chat": ["--new-tokens", "40", "--no-check"],
    "conformer": ["--chunks", "12", "--no-check"],
    "tts": ["--chunks", "12", "--no-check"],
}
_EXAMPLE_FILES = {"quickstart": "quickstart.py", "chat": "streaming_chat.py", "conformer": "streaming_conformer.py",
                  "tts": "streaming_tts.py"}


def _child_example(name: str) -> float:
    import contextlib
    import io

    import flexkv
    from flexkv import StreamSession

    spent = []
    warm_up = StreamSession._warm_up

    def timed(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return warm_up(self, *a, **k)
        finally:
            spent.append(time.perf_counter() - t0)

    StreamSession._warm_up = timed
    path = Path(flexkv.__file__).resolve().parents[1] / "examples" / _EXAMPLE_FILES[name]
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and dynamo look the module up by name
    sys.path.insert(0, str(path.parent))
    spec.loader.exec_module(module)
    with contextlib.redirect_stdout(io.StringIO()):
        if _EXAMPLE_ARGS[name] is None:
            module.main(steps=12, check_from=10)
        else:
            module.main(_EXAMPLE_ARGS[name])
    return sum(spent)


def _child_hf(form: str, cache_kind: str) -> dict:
    """A trained model's `generate()` compiled as `form` (`"forward"` or `"config"`) through `cache_kind`:
    the seconds of the prefill and of the first decode step (the module docstring)."""
    import torch
    from transformers import LogitsProcessorList, StaticCache

    from flexkv import SinkWindow
    from flexkv.integrations.transformers import FlexKVCache
    from flexkv.integrations.transformers.pretrained import load_pretrained, reference_text

    from .real_model_speed import DEFAULT_MODEL

    model, tokenizer = load_pretrained(os.path.expanduser(DEFAULT_MODEL))
    ids = tokenizer(reference_text(), return_tensors="pt").input_ids[:, :512]
    new = 3
    if cache_kind == "flexkv":
        cache = FlexKVCache(model, SinkWindow(4, 252), max_streams=1)
    else:
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new + 1)
    extra = {}
    if form == "forward":
        model.forward = torch.compile(model.forward, fullgraph=True)
    else:
        from transformers import CompileConfig

        config = CompileConfig()  # fullgraph=False, transformers' default: its __call__ holds flexkv's hooks
        config._compile_all_devices = True  # transformers compiles on the CPU only when asked
        extra = dict(compile_config=config)
    stamps = []

    def stamp(input_ids, scores):
        stamps.append(time.perf_counter())
        return scores

    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, do_sample=False, max_new_tokens=new,
                       min_new_tokens=new, logits_processor=LogitsProcessorList([stamp]), pad_token_id=0, **extra)
    prefill, decode = stamps[0] - t0, stamps[1] - stamps[0]
    return dict(compile_s=prefill + decode if form == "forward" else decode, prefill_s=prefill, decode_s=decode,
                step_s=stamps[2] - stamps[1])


def child(case: str) -> None:
    import torch

    torch.set_num_threads(1)
    if case == "model-flexkv":
        s = _child_model(True)
    elif case == "model-ring":
        s = _child_model(False)
    elif case in ("chunk-flexkv", "chunk-ring"):
        s = _child_model(case == "chunk-flexkv", chunk=50)
    elif case in ("dit-flexkv", "dit-ring"):
        s = _child_model(case == "dit-flexkv", chunk=50, dit=True)
    elif case == "session-2-buckets":
        s = _child_model(True, token_sizes=(1, 16))
    elif case == "flexkv-run":
        s = _child_flexkv_run()
    elif case.startswith("example-"):
        s = _child_example(case[len("example-"):])
    elif case in HF_CASES:
        _, form, kind = case.split("-")
        print(json.dumps(_child_hf(form, kind)))
        return
    else:
        raise SystemExit(f"unknown case {case!r}; one of {', '.join(CASES + HF_CASES)}")
    print(json.dumps({"compile_s": s}))


# ----------------------------------------------------------------- parent side


def run_case(case: str, cache_dir: str, layers: int = 4) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, FLEXKV_BENCH_LAYERS=str(layers))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "benchmarks.cold_compile", "--child", case], env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode:
        raise RuntimeError(f"{case} failed:\n{p.stderr[-3000:]}")
    found = json.loads(p.stdout.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return dict(found, cpu_s=cpu, process_s=wall)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES),
                    help="comma-separated subset of " + ",".join(CASES) + "; or of " + ",".join(HF_CASES))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--layers", type=int, default=4,
                    help="layers of the model cases (model-, chunk-, dit-, session-2-buckets); default 4")
    args = ap.parse_args(argv)
    if args.child:
        child(args.child)
        return
    rows = {}
    for case in args.cases.split(","):
        with tempfile.TemporaryDirectory(prefix="inductor-cold-") as d:
            cold = run_case(case, d, args.layers)
            warm = run_case(case, d, args.layers)
        rows[case] = dict(cold=cold, warm=warm)
        parts = "".join(f"; {r}: prefill {x['prefill_s']:.1f} s, first decode step {x['decode_s']:.1f} s, "
                        f"the next {x['step_s'] * 1000:.0f} ms" for r, x in (("cold", cold), ("warm", warm))
                        if "prefill_s" in x)
        print(f"  {case}: cold {cold['compile_s']:.1f} s ({cold['cpu_s']:.0f} CPU s), "
              f"warm {warm['compile_s']:.1f} s ({warm['cpu_s']:.0f} CPU s){parts}", flush=True)
    import torch

    print(f"torch {torch.__version__}, one torch thread per child, {os.cpu_count()} CPUs, "
          f"{args.layers} layers in the model cases")
    head = ("case", "cold compile s", "cold CPU s", "warm compile s", "warm CPU s")
    body = [(c, f"{r['cold']['compile_s']:.1f}", f"{r['cold']['cpu_s']:.0f}", f"{r['warm']['compile_s']:.1f}",
             f"{r['warm']['cpu_s']:.0f}") for c, r in rows.items()]
    for mine, theirs, what in (("model-flexkv", "model-ring", "flexkv model over the ring model"),
                               ("hf-forward-flexkv", "hf-forward-static", "SmolLM2, forward compiled, over StaticCache"),
                               ("hf-config-flexkv", "hf-config-static", "SmolLM2, compile_config, over StaticCache")):
        if mine in rows and theirs in rows:
            f, g = rows[mine]["cold"], rows[theirs]["cold"]
            print(f"cold compile, {what}: {f['compile_s'] / g['compile_s']:.2f}x "
                  f"(CPU seconds {f['cpu_s'] / g['cpu_s']:.2f}x)")
    if args.markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        print("\n".join("| " + " | ".join(r) + " |" for r in body))
    else:
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        print("\n".join("  ".join(x.rjust(wd) for x, wd in zip(r, widths)) for r in (head, *body)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
