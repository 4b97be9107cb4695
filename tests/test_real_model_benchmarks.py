"""Smoke tests of the trained-model benchmarks (speed of generate(), an endless chat, a pass key), tiny sizes.

They run when the model is present (`FLEXKV_TEST_MODEL`, default the GGUF
file `.ci/run` fetches), as tests/test_real_model.py does, and check what
the benchmarks print against what must hold: a bounded cache that has not
evicted anything generates the dynamic cache's tokens, and a chat's cache
bytes do not change from turn to turn, and a pass key is found while it
is inside the window and not once it has left (tests/test_retrieval.py
checks that benchmark's logic on a tiny random model, without this one).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the transformers extra is not installed (pip install -e '.[transformers]')")

from tests.test_real_model import MODEL, needs_model  # noqa: E402


@needs_model
def test_speed_benchmark_prints_the_table_and_equal_tokens(capsys):
    from benchmarks import real_model_speed

    assert real_model_speed.main(["--model", MODEL, "--prompt", "48", "--tokens", "24", "--compiled-tokens", "0",
                                  "--every", "10", "--caches", "flexkv", "dynamic", "--window", "60",
                                  "--prefill-chunk", "16"]) == 0
    out = capsys.readouterr().out
    assert "| flexkv, eager | 24 |" in out and "| dynamic, eager | 24 |" in out
    # the cache column is the memory of the cache built with the prefill chunk asked for, not the default's
    from flexkv import SinkWindow
    from flexkv.integrations.transformers import FlexKVCache
    from flexkv.integrations.transformers.pretrained import load_pretrained

    model, _ = load_pretrained(MODEL)
    mib = [FlexKVCache(model, SinkWindow(4, 60), max_streams=1, prefill_chunk=c).memory_bytes / 2**20 for c in (16, 64)]
    assert f"{mib[0]:.1f}" != f"{mib[1]:.1f}"
    assert out.split("| flexkv, eager | 24 |")[1].split("\n")[0].split("|")[4].strip() == f"{mib[0]:.1f}"
    assert "| cache | 10 | 20 |" in out
    # 48 + 24 tokens fit sink 4 + window 60 until the 9th new token; the first 8 must match the model's own cache
    first = int(out.split("flexkv, eager: first ")[1].split()[0])
    assert first >= 8


@needs_model
def test_speed_benchmark_refuses_bad_sizes(capsys):
    from benchmarks import real_model_speed

    with pytest.raises(SystemExit):
        real_model_speed.main(["--tokens", "-1"])
    assert "--tokens must be at least 1 (or 0 with --compiled-tokens above 0: compiled runs only), got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        real_model_speed.main(["--prefill-chunk", "0"])
    assert "--prefill-chunk must be at least 1 (or left out for FlexKVCache's default), got 0" in capsys.readouterr().err


@needs_model
def test_chat_keeps_its_memory_flat_and_prints_both_answers(capsys):
    from benchmarks import real_model_chat

    assert real_model_chat.main(["--model", MODEL, "--tokens", "300", "--window", "124", "--filler", "120",
                                 "--reply", "8", "--answer", "8"]) == 0
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) >= 4
    assert len({row[5].strip() for row in rows}) == 1  # cache MiB: the same every turn
    lengths = [int(row[4]) for row in rows]
    assert lengths == sorted(lengths) and lengths[-1] > 300
    assert "(the model's own DynamicCache:" in out and ", same)" in out  # nothing evicted in turn 1
    assert "'What is the capital of France?':" in out


@needs_model
def test_retrieval_finds_the_key_inside_the_window_and_not_past_it(capsys):
    import torch

    from benchmarks import retrieval

    threads = torch.get_num_threads()
    try:  # one thread: on a busy 2-core machine a second one makes these small forwards several times slower
        assert retrieval.main(["--model", MODEL, "--trials", "1", "--distances", "8", "80", "--window", "40",
                               "--max-prefix", "8", "--caches", "dynamic", "cache", "--threads", "1", "--quiet"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "| cache | N = 8 | N = 80 |" in out
    assert "| transformers' DynamicCache (the model's own) | 1/1 (100%) | 1/1 (100%) |" in out
    # the key's last digit 80 + 18 tokens before the answer: past SinkWindow(4, 40), the key is gone
    assert "| sinks + window, FlexKVCache's default positions (positions: cache) | 1/1 (100%) | 0/1 (0%) |" in out
