"""`vllm serve` under load: flexkv's plugin against stock vLLM's plain sliding window and stock dense.

    VLLM_CPU_KVCACHE_SPACE=2 python -m benchmarks.vllm_serve_load --model FOLDER \\
        --modes flexkv sliding dense --streams 32 --input-len 8000 --output-len 400 --rate 4

For each mode one server is started as an operator starts it (vLLM's OpenAI server by its module
path, vLLM's defaults otherwise: the engine core in its own process, compiled graphs, prefix
caching on) and loaded by vLLM's own load generator (`vllm.benchmarks.serve`, what `vllm bench
serve` runs; vllm-cpu's `vllm` console script stops before parsing, so it is called as a module):
`--streams` requests of `--input-len` random prompt tokens, each generating `--output-len` tokens
(EOS ignored), arriving as a Poisson process at `--rate` requests/s, all of them allowed in flight
at once. Modes:

- `flexkv`: `additional_config={"flexkv": {"sink": S, "window": W}}` (in-cache positions, the
  default), `max_model_len` = prompt + generation;
- `sliding`: stock vLLM with every layer a plain sliding window of `S + W + 1` keys
  (`hf_overrides={"sliding_window": ...}`): the same memory bound, vLLM's kernel, stream positions;
- `dense`: stock vLLM at the model's own `max_model_len` (8,192 for SmolLM2).

Both stock modes serve at most the model's own context, the prompts (and the teacher-forced stream)
shortened so that they fit: stock vLLM's rotary table has that many rows, and a sliding-window
engine asked for a longer stream (`VLLM_ALLOW_LONG_MAX_MODEL_LEN`) dies in its first step past it
("index out of bounds: 0 <= tmp8 < 8192" in the rotary kernel, vllm-cpu 0.32.0). A mode that fails
is printed as a row with its error, and the next mode runs.

Each server answers one short request before the load (its graphs compiled, as in service). Printed
per mode, from vLLM's generator: completed requests, output tokens/s, time to first token
and inter-token latency (median and p99); from the server's `/metrics`, sampled every half second:
preemptions, the most requests running and waiting at once, and the peak of the KV pool in use
(`vllm:kv_cache_usage_perc` times the pool's blocks); and the quality of what came back: one more
request during the load, a teacher-forced stream of natural text (`--quality-len` tokens of
Python's own documentation, as `tests/test_vllm.py` builds it, shortened for `dense`) whose prompt
logprobs give the perplexity of the tokens past the first `S + W + 1` and of its last 1,000, beside
the same stream's perplexity served alone before the load (what the load changed).

Needs the `vllm` extra's environment and a transformers folder of the model (docs/vllm.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Optional

#: the model's own context (SmolLM2); `dense` serves at most this
TRAINED = 8192


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(mode: str, model: str, port: int, sink: int, window: int, max_len: int,
                batched_tokens: Optional[int] = None) -> list:
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--host", "127.0.0.1", "--dtype", "float32", "--block-size", "32", "--seed", "0",
            "--max-model-len", str(max_len)]
    if batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(batched_tokens)]
    if mode == "flexkv":
        args += ["--additional-config", json.dumps({"flexkv": {"sink": sink, "window": window}})]
    elif mode == "sliding":
        args += ["--hf-overrides", json.dumps({"sliding_window": sink + window + 1})]
    return args


def start(mode: str, model: str, sink: int, window: int, max_len: int, log_path: str, limit: float = 600.0,
          batched_tokens: Optional[int] = None):
    port = free_port()
    env = dict(os.environ, VLLM_ALLOW_LONG_MAX_MODEL_LEN="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    proc = subprocess.Popen(server_args(mode, model, port, sink, window, max_len, batched_tokens), stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the {mode} server exited at start-up:\n" + open(log_path).read()[-3000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return proc, port
        except OSError:
            time.sleep(2)
    proc.terminate()
    raise RuntimeError(f"the {mode} server was not ready in {limit:.0f} s:\n" + open(log_path).read()[-3000:])


def metric_values(text: str, name: str) -> list:
    """Every sample of metric `name` on a Prometheus page: `[(labels, value)]`."""
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels = line[len(name):].split("}")[0].lstrip("{") if "{" in line else ""
            out.append((labels, float(line.rsplit(" ", 1)[1])))
    return out


class Sampler(threading.Thread):
    """Reads `/metrics` every `every` seconds until stopped: peaks and the last preemption count."""

    def __init__(self, port: int, every: float = 0.5):
        super().__init__(daemon=True)
        self.url, self.every, self.stop = f"http://127.0.0.1:{port}/metrics", every, threading.Event()
        self.peak = dict(usage=0.0, running=0.0, waiting=0.0)
        self.preemptions, self.blocks = 0.0, None

    def read(self) -> None:
        with urllib.request.urlopen(self.url, timeout=10) as r:
            text = r.read().decode()
        for key, name in (("usage", "vllm:kv_cache_usage_perc"), ("running", "vllm:num_requests_running"),
                          ("waiting", "vllm:num_requests_waiting")):
            self.peak[key] = max([self.peak[key]] + [v for _, v in metric_values(text, name)])
        self.preemptions = sum(v for _, v in metric_values(text, "vllm:num_preemptions_total"))
        for labels, _ in metric_values(text, "vllm:cache_config_info"):
            for part in labels.split(","):
                if part.startswith("num_gpu_blocks="):
                    self.blocks = int(part.split("=")[1].strip('"'))

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.read()
            except OSError:
                pass
            self.stop.wait(self.every)


def natural_ids(model: str, n: int) -> list:
    """`n` token ids of Python's documentation topics, as tests/test_vllm.py's reference text."""
    from pydoc_data.topics import topics

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model)
    ids = tok("\n\n".join(topics[key] for key in sorted(topics)), add_special_tokens=False)["input_ids"]
    if len(ids) < n:
        raise ValueError(f"the reference text has {len(ids)} tokens, fewer than --quality-len={n}")
    return ids[:n]


def perplexities(port: int, model: str, ids: list, skip: int) -> dict:
    """Teacher-forced perplexity of `ids` from the server's prompt logprobs: past `skip` tokens, and of the last
    1,000."""
    body = dict(model=model, prompt=ids, max_tokens=1, prompt_logprobs=0, temperature=0.0)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read().decode()[:300]}") from None
    rows = out["choices"][0]["prompt_logprobs"]
    nll = [-(row[str(t)]["logprob"]) for row, t in zip(rows[1:], ids[1:])]  # row i scores token i
    return dict(tokens=len(ids), past_window=math.exp(sum(nll[skip:]) / len(nll[skip:])),
                last_1000=math.exp(sum(nll[-1000:]) / 1000))


def warm_up(port: int, model: str) -> None:
    """One short request first, so the load meets a warm server (graphs compiled, as in service)."""
    body = dict(model=model, prompt=[1] * 40, max_tokens=8, temperature=0.0)
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        r.read()


def load(port: int, model: str, streams: int, input_len: int, output_len: int, rate: float) -> dict:
    """vLLM's own load generator against the server; its result dict."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}", "--model", model, "--tokenizer", model,
        "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--num-prompts", str(streams), "--request-rate", str(rate), "--max-concurrency", str(streams),
        "--ignore-eos", "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
        "--seed", "0"])
    return bench_main(args)


def run_mode(mode: str, a) -> dict:
    stock = mode != "flexkv"  # stock vLLM's rotary table stops at the model's context: a longer stream crashes it
    max_len = TRAINED if stock else max(a.input_len + a.output_len, a.quality_len) + 64
    input_len = min(a.input_len, TRAINED - a.output_len - 64) if stock else a.input_len
    quality_len = min(a.quality_len, TRAINED - 64) if stock else a.quality_len
    log_path = os.path.join(a.logs, f"serve-{mode}.log")
    proc, port = start(mode, a.model, a.sink, a.window, max_len, log_path, batched_tokens=a.batched_tokens)
    row = dict(mode=mode, input_len=input_len, output_len=a.output_len, max_model_len=max_len)
    sampler = Sampler(port)
    try:
        warm_up(port, a.model)
        ids = natural_ids(a.model, quality_len)
        row["quality_alone"] = perplexities(port, a.model, ids, a.sink + a.window + 1)
        sampler.read()
        sampler.start()
        quality: dict = {}

        def teacher_forced():
            try:
                quality.update(perplexities(port, a.model, ids, a.sink + a.window + 1))
            except Exception as e:  # noqa: BLE001 - reported in the row
                quality["error"] = f"{type(e).__name__}: {e}"

        side = threading.Thread(target=teacher_forced, daemon=True)
        t0 = time.monotonic()
        side.start()
        result = load(port, a.model, a.streams, input_len, a.output_len, a.rate)
        side.join()
        row["wall_s"] = time.monotonic() - t0
    finally:
        sampler.stop.set()
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    row.update({k: result.get(k) for k in ("completed", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
                                             "median_itl_ms", "p99_itl_ms", "duration")})
    row.update(preemptions=sampler.preemptions, peak_running=sampler.peak["running"],
               peak_waiting=sampler.peak["waiting"], pool_blocks=sampler.blocks,
               peak_blocks=None if sampler.blocks is None else round(sampler.peak["usage"] * sampler.blocks),
               quality=quality)
    return row


def print_table(rows: list) -> None:
    print("| mode | prompt + generation | completed | output tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | "
          "preemptions | peak running | peak blocks / pool | ppl past window (alone) | ppl last 1,000 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['mode']} | failed: {r['error'][:200]} |")
            continue
        q = r["quality"]
        alone = r.get("quality_alone", {}).get("past_window", float("nan"))
        ppl = (f"{q['past_window']:.2f} ({alone:.2f}) | {q['last_1000']:.2f}" if "past_window" in q
               else f"{q.get('error')} |")
        print(f"| {r['mode']} | {r['input_len']} + {r['output_len']} | {r['completed']} | {r['output_throughput']:.1f} | "
              f"{r['median_ttft_ms'] / 1e3:.1f} / {r['p99_ttft_ms'] / 1e3:.1f} | "
              f"{r['median_itl_ms']:.0f} / {r['p99_itl_ms']:.0f} | {r['preemptions']:.0f} | {r['peak_running']:.0f} | "
              f"{r['peak_blocks']} / {r['pool_blocks']} | {ppl} |")


def main(argv: Optional[list] = None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a transformers folder of the model")
    ap.add_argument("--modes", nargs="+", choices=("flexkv", "sliding", "dense"), default=["flexkv", "sliding", "dense"])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=8000)
    ap.add_argument("--output-len", type=int, default=400)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson arrivals)")
    ap.add_argument("--quality-len", type=int, default=8400, help="tokens of the teacher-forced stream")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--window", type=int, default=1020)
    ap.add_argument("--batched-tokens", type=int, default=None, help="vLLM's max_num_batched_tokens (default: vLLM's)")
    ap.add_argument("--logs", default=None, help="folder for each server's log (default: a new temporary folder)")
    ap.add_argument("--json", default=None, help="write the rows to this file")
    a = ap.parse_args(argv)
    if a.logs is None:
        a.logs = tempfile.mkdtemp(prefix="flexkv-serve-load-")
    print(f"server logs in {a.logs}", flush=True)
    rows = []
    for mode in a.modes:
        try:
            rows.append(run_mode(mode, a))
        except Exception as e:  # noqa: BLE001 - reported as the mode's row; the next mode runs
            rows.append(dict(mode=mode, error=f"{type(e).__name__}: {str(e)[:500]}"))
        print(json.dumps(rows[-1], default=str), flush=True)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(rows, fh, indent=2, default=str)
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
