"""flexkv under vLLM's OpenAI-compatible server, as operators start it: vLLM's defaults (the engine core
in a process of its own, the model compiled, prefix caching on), spoken to over HTTP on localhost.

Skipped where vLLM is not installed or the trained SmolLM2 folder is absent (tests/test_vllm.py's
`smol_dir`). The server's greedy completions, plain and streamed (the second served from the prefix
cache the first filled), must equal the offline engine's for the same prompt past the first eviction;
a bad `flexkv` entry must stop the server at start-up with flexkv's message; flexkv's metrics on `/metrics`
must count what the retention evicted and returned, worked out by hand from the answers' token counts;
under vLLM's own load generator every stream keeps its block bound and a teacher-forced stream's
perplexity is what it is alone.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm")

from test_vllm import smol_dir  # noqa: E402

SINK, WINDOW = 4, 60
ENTRY = json.dumps({"flexkv": {"sink": SINK, "window": WINDOW}})
#: what the server and the offline engine share; vLLM's defaults otherwise (compiled, prefix caching on)
COMMON = ["--dtype", "float32", "--max-model-len", "1024", "--block-size", "32", "--seed", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(folder, entry, log_path, port):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the engine core in its own process
    # vllm-cpu 0.32.0's `vllm` console script stops before parsing (it asks importlib.metadata for a
    # distribution named "vllm"; this one is "vllm-cpu"), so the same server starts by its module path.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--port", str(port),
           "--host", "127.0.0.1", "--additional-config", entry, "--enable-prompt-tokens-details", *COMMON]
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)


def post(port, path, body, stream=False):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        if not stream:
            return json.loads(r.read())
        chunks = []
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
        return chunks


class Metrics(dict):
    """A `/metrics` page: name -> value of the one sample of each flexkv metric, and the page's `text`."""

    def __init__(self, text):
        super().__init__()
        self.text = text
        for line in text.splitlines():
            if line.startswith("flexkv:"):
                name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
                assert name not in self, f"{name} has more than one sample on one engine:\n{text}"
                self[name] = value


def scrape(port, name, expected, limit=30.0):
    """The server's `/metrics` once `name` reads `expected` (the engine client records a finished request's
    statistics just after handing back its answer), or after `limit` seconds."""
    start = time.time()
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            page = Metrics(r.read().decode())
        if page.get(name) == expected or time.time() - start > limit:
            return page
        time.sleep(0.5)


def wait_ready(proc, port, log_path, limit=420):
    start = time.time()
    while time.time() - start < limit:
        if proc.poll() is not None:
            raise AssertionError("the server exited at start-up:\n" + open(log_path).read()[-4000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise AssertionError(f"the server was not ready in {limit} s:\n" + open(log_path).read()[-4000:])


@pytest.fixture(scope="module")
def folder():
    path = smol_dir()
    if path is None:
        pytest.skip("no converted SmolLM2 folder (see tests/test_vllm.py's smol_dir)")
    return path


def test_the_openai_server_generates_what_the_offline_engine_does(folder, tmp_path):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    from pydoc_data.topics import topics

    prompt = tok.decode(tok(topics[sorted(topics)[3]], add_special_tokens=False)["input_ids"][:100])
    new = 80  # 100 + 80 tokens: past sink + window + 1 = 65, so the stream evicts as it goes
    port, log = free_port(), tmp_path / "serve.log"
    proc = serve(folder, ENTRY, log, port)
    try:
        wait_ready(proc, port, log)
        first = post(port, "/v1/completions", dict(model=folder, prompt=prompt, max_tokens=new, temperature=0,
                                                   ignore_eos=True))
        text = first["choices"][0]["text"]
        chunks = post(port, "/v1/completions", dict(model=folder, prompt=prompt, max_tokens=new, temperature=0,
                                                    ignore_eos=True, stream=True,
                                                    stream_options={"include_usage": True}), stream=True)
        streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        usage = [c["usage"] for c in chunks if c.get("usage")][-1]
        chat = post(port, "/v1/chat/completions", dict(model=folder, max_tokens=new, temperature=0,
                                                       messages=[{"role": "user", "content": prompt}]))
        # flexkv's metrics beside vLLM's, worked by hand from each request's token counts: a stream that
        # wrote w tokens (prompt + completion - 1) evicted w - 64 (sink 4 + window 60); with prefix caching
        # the blocks below the window's start max(4, w - 60) and above the sink block (block 0) were returned
        written = [u["prompt_tokens"] + u["completion_tokens"] - 1 for u in (first["usage"], usage, chat["usage"])]
        evicted = sum(max(0, w - SINK - WINDOW) for w in written)
        returned = sum(max(0, max(SINK, w - WINDOW) // 32 - 1) for w in written)
        assert evicted > 0 and returned > 0
        metrics = scrape(port, "flexkv:evicted_tokens_total", evicted)
        # a request wider than the engine: a client error naming the value, and the server serves on
        try:
            post(port, "/v1/completions", dict(model=folder, prompt=prompt, max_tokens=4,
                                               vllm_xargs={"flexkv_window": 61}))
            refused = None
        except urllib.error.HTTPError as e:
            refused = (e.code, e.read().decode())
        again = post(port, "/v1/completions", dict(model=folder, prompt=prompt, max_tokens=new, temperature=0,
                                                   ignore_eos=True))["choices"][0]["text"]
        # requests keeping less than the engine (flat vllm_xargs keys over HTTP): served, each under its own
        narrow = [post(port, "/v1/completions", dict(model=folder, prompt=prompt, max_tokens=new, temperature=0,
                                                     ignore_eos=True, vllm_xargs=xargs))
                  for xargs in ({"flexkv_window": 60}, {"flexkv_window": 5, "flexkv_sink": 1},
                                {"flexkv_window": 5, "flexkv_sink": 1})]
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    assert proc.returncode is not None
    logged = log.read_text()
    assert "each query reads at most 65 keys" in logged and "positions 'cache'" in logged
    assert "a request may keep less (SamplingParams extra_args" in logged
    assert "prefix caching on" in logged and "Enforce eager" not in logged
    assert "flexkv: a request under SinkWindow(sink=4, window=60" in logged and "such streams at once" in logged
    assert text == streamed and len(text) > 50
    # the same prompt again resumed from the whole blocks the first request cached
    assert usage["prompt_tokens_details"]["cached_tokens"] == (usage["prompt_tokens"] - 1) // 32 * 32 > 0, usage
    assert chat["choices"][0]["message"]["content"]
    assert refused is not None and refused[0] == 400, refused
    assert "window must be an int in [1, 60]" in refused[1] and "got 61" in refused[1], refused
    assert again == text
    # the engine's own window asked for explicitly is the engine's request; a narrower one attends less (its
    # text differs), the same again is the same, resuming from the blocks the first cached under its retention
    assert narrow[0]["choices"][0]["text"] == text
    assert narrow[1]["choices"][0]["text"] != text and narrow[2]["choices"][0]["text"] == narrow[1]["choices"][0]["text"]
    assert narrow[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert narrow[2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert metrics["flexkv:evicted_tokens_total"] == evicted
    assert metrics["flexkv:returned_blocks_total"] == returned
    assert metrics["flexkv:blocks_held"] == 0  # nothing runs once every answer is in
    assert metrics["flexkv:retention_info"] == 1 and 'sink="4"' in metrics.text and 'window="60"' in metrics.text

    from vllm import LLM, SamplingParams

    # the offline engine eager (the attention path tests/test_vllm.py checks against the reference): the
    # compiled server must give what it gives
    llm = LLM(folder, dtype="float32", max_model_len=1024, block_size=32, seed=0, enforce_eager=True,
              additional_config=json.loads(ENTRY))
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=new, temperature=0, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].text == text


def test_a_bad_entry_stops_the_server_at_start_up_with_flexkvs_message(folder, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    proc = serve(folder, json.dumps({"flexkv": {"sink": 4}}), log, port)
    try:
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "needs ['window']" in log.read_text()


def test_under_load_every_stream_keeps_its_bound_and_what_came_back_is_what_it_is_alone(folder, tmp_path):
    """benchmarks/vllm_serve_load.py small: a server with the flexkv entry under vLLM's own load generator (six
    600-token prompts arriving at once, 30 tokens each) and a teacher-forced 700-token stream among them. Every
    request completes, nothing is preempted, the pool never holds more than the plugin's per-stream bound for
    each request in flight, and the stream's perplexity under the load is what it is served alone."""
    from argparse import Namespace
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])  # `benchmarks` is a folder of the repository, not the package
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.vllm_serve_load import run_mode
    from flexkv import SinkWindow
    from flexkv.integrations.vllm.spec import SCRATCH_BLOCKS, block_bound

    a = Namespace(model=folder, sink=4, window=60, streams=6, input_len=600, output_len=30, rate=100.0,
                  quality_len=700, batched_tokens=64, logs=str(tmp_path))
    row = run_mode("flexkv", a)
    assert row["completed"] == 6 and row["preemptions"] == 0, row
    per_stream = block_bound(SinkWindow(4, 60), 32, 64) + SCRATCH_BLOCKS  # vllm serve: prefix caching on
    assert 0 < row["peak_blocks"] <= (a.streams + 1) * per_stream < (a.streams + 1) * (700 // 32), row
    load, alone = row["quality"], row["quality_alone"]
    assert abs(load["past_window"] / alone["past_window"] - 1) < 0.01, row
