"""`flexkv run` and `flexkv show` from the command line, and their error handling."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexkv import BoundedKVConfig, BoundedKVStep, Segment, SinkWindow, StreamPosition
from flexkv.cli import main
from flexkv.cli.traffic import Traffic
from flexkv.cli.workload import load_workload
from flexkv.model.reference import ReferenceCache

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
TINY = DATA / "tiny-run.yaml"


def flexkv(*args, timeout=300):
    """Run `python -m flexkv ARGS` the way a user would; returns the CompletedProcess."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("FLEXKV_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "flexkv", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=str(ROOT))


# --------------------------------------------------------------------- run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "report.json"
    proc = flexkv("run", TINY, "--threads", "1", "--json", out)
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


def test_run_report_fields_and_accounting(tiny_run):
    proc, rep = tiny_run
    w = load_workload(str(TINY))
    # Replay the seeded traffic on its own: the report must account exactly what it ran.
    t = Traffic(w)
    tokens, calls, arrived, finished = 0, 0, len(t.active), 0
    for _ in range(w.steps):
        # one regular call for the lanes in their regular phase, one more when some lane writes its last chunk
        regular = [r for r in t.lanes if r is not None and not r.final]
        final = [r for r in t.lanes if r is not None and r.final]
        calls += 1 + bool(final)
        tokens += w.span * len(regular) + w.final_span * len(final)
        t.advance()
        finished += len(t.departed)
        arrived += len(t.arrived)
    assert rep["steps"] == w.steps == 40
    assert rep["calls"] == calls and calls > w.steps  # some steps carried a last chunk
    assert rep["tokens"] == tokens
    assert rep["requests"]["arrived"] == arrived and rep["requests"]["finished"] == finished
    assert rep["tokens_per_s"] > 0
    assert 0 < rep["step_ms"]["p50"] <= rep["step_ms"]["p95"] <= rep["step_ms"]["max"]
    assert rep["compile_s"] > 0
    # Two batch shapes (T 4 and the last chunk's T 5) x 2 layers, all compiled in the warm-up.
    assert rep["graphs_compiled"] == 4
    assert rep["recompiles_after_warmup"] == 0
    assert 0 < rep["plan_ms"]["p50"] and 0 < rep["plan_ms"]["fraction_of_step"] < 1


def test_run_reports_the_process_memory(tiny_run):
    """The report gives the process's resident memory after warm-up and at the end, its growth per 1,000
    finished requests from those two, and the text report prints them."""
    proc, rep = tiny_run
    p = rep["process"]
    assert p["rss_start_bytes"] > 0 and p["rss_end_bytes"] > 0
    finished = rep["requests"]["finished"]
    assert finished > 0
    assert p["rss_growth_per_1000_requests_bytes"] == pytest.approx(
        (p["rss_end_bytes"] - p["rss_start_bytes"]) * 1000 / finished)


def test_the_reference_tracker_keeps_only_what_a_check_reads():
    """A tracked request's host copy holds the chunks with its first `sink` entries and those with its
    last `window + max step` entries, however long it runs; `stream` gives the whole written length
    with the kept entries where they were and zeros where chunks were dropped."""
    from flexkv.cli.runner import _Tracker

    w = load_workload(str(TINY)).replace(reverse_step_order=False)
    tracker = _Tracker(w, limit=1)
    tracker.offer(7)
    written, span = 0, 3
    for _ in range(60):  # 180 entries, far past sink + window + T
        # token i of the stream carries the value i + 1 in every cell (0 is what a dropped entry reads)
        k = (torch.arange(written, written + span, dtype=w.torch_dtype) + 1).view(1, 1, span, 1).expand(
            w.rows, w.kv_heads, span, w.head_dim)
        tracker.record(7, slice(0, w.rows), span, [(None, k, -k, None)] * w.layers)
        written += span
        assert tracker.stored_entries(7) <= w.sink + tracker.tail + 2 * span
    keys, values = tracker.stream(7)
    assert len(keys) == w.layers and keys[0].shape == (w.rows, w.kv_heads, written, w.head_dim)
    got = keys[0][0, 0, :, 0]
    kept = [i for i in range(written) if got[i] != 0]
    assert all(got[i] == i + 1 for i in kept) and torch.equal(values[0], -keys[0])
    assert set(range(w.sink)) <= set(kept) and set(range(written - tracker.tail, written)) <= set(kept)
    assert len(kept) < written // 2  # the middle went


def test_run_memory_is_the_slots_and_flat(tiny_run):
    _, rep = tiny_run
    m = rep["memory"]
    # Hand count: a slot row is sink_capacity (6 - 4 = 2) + ring (window 10 + max T 5) = 17 cells;
    # 2 rows x 2 layers x keys and values x 2 heads x 16 dims x 4 bytes.
    assert m["slot_bytes"] == 17 * 2 * 2 * 2 * 2 * 16 * 4
    assert m["slots_bytes"] == 3 * m["slot_bytes"]
    # Two sources of 4 entries, 2 rows, 2 layers, keys and values.
    assert m["sources_bytes"] == 2 * 4 * (2 * 2 * 2 * 2 * 16 * 4)
    assert m["memory_bytes"] == m["slots_bytes"] + m["sources_bytes"] + m["other_bytes"]
    assert 0 <= m["other_bytes"] < m["slot_bytes"]  # scratch cells and block padding only
    assert m["flat"] is True
    series = rep["series"]
    assert len(series) == 40 and {p["bounded_bytes"] for p in series} == {m["memory_bytes"]}
    assert m["unbounded_bytes_peak"] == max(p["unbounded_bytes"] for p in series)
    assert m["unbounded_bytes_peak"] > m["slots_bytes"]  # streams grew past what the slots hold


def test_run_matches_reference_after_wrap(tiny_run):
    _, rep = tiny_run
    ref = rep["reference"]
    assert len(ref["checks"]) == 4
    assert ref["max_abs_error"] < 1e-4
    assert all(c["max_abs_error"] < 1e-4 for c in ref["checks"])
    # The ring holds window 10 + 5 cells: at least one check comes after it wrapped.
    assert any(c["written"] > 15 for c in ref["checks"])
    assert rep["requests"]["longest_stream"] > 6 + 10


def test_run_prints_report_and_progress(tiny_run):
    proc, rep = tiny_run
    out = proc.stdout.splitlines()
    assert out[0] == "flexkv run: tiny-run (small)"
    heads = [line.split()[0] for line in out[2:]]
    assert heads == ["steps", "step", "compile", "planning", "memory", "unbounded", "process", "requests", "reference", "wall"]
    assert "recompiles after warm-up: 0" in proc.stdout
    assert "rings wrapped" in proc.stdout
    assert proc.stderr.splitlines()[-1].startswith("[40/40]")
    assert "Traceback" not in proc.stderr


def test_load_stream_matches_replay():
    """The reference check relies on load_stream: it must equal feeding the same tokens through steps."""
    cfg = BoundedKVConfig(2, 2, 8, 1, 0, SinkWindow(2, 5), max_sources=0, max_step_tokens=3)
    g = torch.Generator().manual_seed(0)
    a, b = ReferenceCache(cfg), ReferenceCache(cfg)
    keys, values = [[] for _ in range(2)], [[] for _ in range(2)]
    written = 0
    for _ in range(4):
        st = BoundedKVStep((Segment("r", 3),), {"r": StreamPosition(0, written)})
        for l in range(2):
            q, k, v = (torch.randn(1, 2, 3, 8, generator=g) for _ in range(3))
            a.attend(l, q, k, v, st)
            keys[l].append(k[0])
            values[l].append(v[0])
        a.commit(st)
        written += 3
    b.load_stream("r", [torch.cat(x, 1)[None] for x in keys], [torch.cat(x, 1)[None] for x in values])
    st = BoundedKVStep((Segment("r", 2),), {"r": StreamPosition(0, written)}, tokens=3)
    for l in range(2):
        q, k, v = (torch.randn(1, 2, 3, 8, generator=g) for _ in range(3))
        assert torch.equal(a.attend(l, q, k, v, st), b.attend(l, q, k, v, st))
    with pytest.raises(ValueError, match="layers"):
        b.load_stream("r", keys[0], values[0][:1])


# -------------------------------------------------------------------- show

SHOW_YAML = """\
name: hand
layers: 1
kv_heads: 1
head_dim: 8
source_len: 3
sink: 2
window: 4
span: 2
tokens: 3
requests: 2
stream_len: [1, 1]
block_size: 4
"""


def test_show_hand_worked_source_ring_lookahead(tmp_path, capsys):
    cfg = tmp_path / "hand.yaml"
    cfg.write_text(SHOW_YAML)
    assert main(["show", str(cfg), "--source-len", "3", "--written", "6", "--span", "2", "--T", "3",
                 "--slot", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # n = 3 + 6 = 9. Sink 2 lies inside the source (entries 0-1); the window keeps 5-8
    # (lo = max(2, 9 - 4)); own tokens 9, 10 are written, 11 is look-ahead. The slot has no
    # sink region (sink <= source_len) and a ring of 4 + 3 cells: entry j sits in ring cell j % 7.
    # Blocks of 4 cells: source row 0 = cells 0-2 (block 0); slot 1 = cells 3 + 7 = 10-16
    # (blocks 2-4).
    assert lines[0] == "flexkv show: hand (small)"
    assert lines[1] == "retention: sink 2, window 4, per-step window"
    assert lines[2] == ("position: source_len 3, written 6 -> n = 9; "
                        "step: span 2, T 3 -> own tokens 9-11 (9-10 written, 11 look-ahead)")
    assert lines[3] == "slot 1: sink region 0 cells, ring 7 cells (window 4 + 3 for the step's own tokens)"
    assert lines[4] == ""
    assert lines[5] == "       0         1"
    assert lines[6] == "index  012345678901"
    assert lines[7] == "t=0-2  SS...WWWWOOA"
    assert lines[8] == ""
    assert lines[9] == "where:"
    assert lines[10] == "  S  0-1   source 0, entries 0-1"
    assert lines[11] == "  W  5-8   ring cells 5-6, 0-1"
    assert lines[12] == "  O  9-10  ring cells 2-3"
    assert lines[13] == "  A  11    ring cell 4 (look-ahead: overwritten by a later step)"
    assert lines[14] == "KV blocks visited (block 4 cells): 0, 2-4"
    assert lines[15].startswith("legend: S source entry")
    assert len(lines) == 16


def test_show_hand_worked_per_query_with_sink(tmp_path, capsys):
    cfg = tmp_path / "pq.yaml"
    cfg.write_text(SHOW_YAML.replace("source_len: 3", "source_len: 0").replace("window: 4", "window: 5")
                   + "query_window: 4\n")
    assert main(["show", str(cfg), "--written", "9", "--span", "3", "--T", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Query t sits at p = 9 + t and sees p-4 .. p plus the sinks 0-1 (kept in the slot's
    # 2-cell sink region). Ring of 5 + 3 = 8 cells: 5,6,7 -> cells 5-7, 8 -> 0, own 9-11 -> 1-3.
    assert lines[1] == "retention: sink 2, window 5, per-query window 4"
    assert lines[3] == "slot 0: sink region 2 cells, ring 8 cells (window 5 + 3 for the step's own tokens)"
    assert lines[6:10] == [
        "index  012345678901",
        "t=0    KK...WWWWO..",
        "t=1    KK....WWWOO.",
        "t=2    KK.....WWOOO",
    ]
    assert lines[11:14] == [
        "where:",
        "  K  0-1   sink cells 0-1",
        "  W  5-8   ring cells 5-7, 0",
    ]
    assert lines[14] == "  O  9-11  ring cells 1-3"


RECALL_YAML = """\
name: recall
layers: 2
kv_heads: 2
head_dim: 16
q_heads: 4
sink: 2
window: 6
memory: 8
memory_block: 4
top_k: 1
span: 2
tokens: 2
requests: 3
stream_len: [20, 40]
arrival: 0.5
steps: 40
seed: 1
check_steps: 4
check_requests: 2
"""


def test_show_hand_worked_recall_memory_and_tail(tmp_path, capsys):
    cfg = tmp_path / "recall.yaml"
    cfg.write_text(RECALL_YAML)
    assert main(["show", str(cfg), "--written", "21", "--span", "1", "--T", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # n = 21: the window is 15-20; blocks of 4 from the sinks' end: 2-5, 6-9, 10-13 are whole before 15, the
    # memory keeps the newest 2 (6-13), 14 is the tail (its block 14-17 is not whole); 2-5 has left the memory.
    assert lines[1] == "retention: Recall: sink 2, window 6, per-step window"
    assert lines[3] == ("slot 0: sink region 2 cells, ring 19 cells (window 6 + memory 8 + 3 for the block leaving "
                        "the window + 2 for the step's own tokens)")
    assert lines[4].startswith("memory: 2 blocks of 4 entries, the 1 whose mean key")
    assert lines[8] == "t=0    KK....MMMMMMMMLWWWWWWO"


def test_run_with_a_memory_equals_the_reference(tmp_path):
    cfg = tmp_path / "recall.yaml"
    cfg.write_text(RECALL_YAML)
    out = tmp_path / "report.json"
    proc = flexkv("run", cfg, "--threads", "1", "--json", out)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert "memory 8 in blocks of 4, top 1" in proc.stdout
    ref = report["reference"]
    assert len(ref["checks"]) == 4 and ref["max_abs_error"] < 1e-4
    # Checked past the point where the memory is full and its oldest block has left (2 + 6 + 8 + 3 entries).
    assert any(c["written"] > 2 + 6 + 8 + 3 for c in ref["checks"])


def test_a_memory_that_counts_the_step_in_its_window_is_refused(tmp_path, capsys):
    cfg = tmp_path / "recall.yaml"
    cfg.write_text(RECALL_YAML + "window_includes_step: true\n")
    assert main(["run", str(cfg)]) != 0
    assert "window_includes_step" in capsys.readouterr().err


def test_show_long_stream_draws_runs(capsys):
    # The built-in workload (sink 4, window 252): at written 1000 the picture is drawn as runs.
    assert main(["show", "--written", "1000"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "t=0    K 0-3 | . 4-747 | W 748-999 | O 1000" in out
    # Ring of 253 cells: 748 % 253 = 242, 999 % 253 = 240, own 1000 -> 241.
    assert "  W  748-999  ring cells 242-252, 0-240" in out
    assert "  O  1000     ring cell 241" in out


# ------------------------------------------------------------------ errors


def _one_line_error(code, err, *needles):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["run", "--steps", "0"], ["--steps", "expected an integer >= 1, got 0"]),
        (["run", "--steps", "many"], ["--steps", "'many'"]),
        (["run", "--compile", "fast"], ["--compile", "invalid choice"]),
        (["run", "no/such.yaml"], ["no such config file: no/such.yaml"]),
        (["show", "--T", "5"], ["T=5 exceeds the config's max_step_tokens=1"]),
        (["show", "--span", "2"], ["T=2 exceeds the config's max_step_tokens=1"]),
        (["show", "--slot", "99"], ["slot=99", "max_slots=16"]),
        (["frobnicate"], ["invalid choice"]),
        ([], ["missing command"]),
    ],
)
def test_bad_arguments_one_line(argv, needles, capsys):
    code = main(argv)
    _one_line_error(code, capsys.readouterr().err, *needles)


@pytest.mark.parametrize(
    "text, needles",
    [
        ("name: x\nlayers: 2\n  kv_heads: 3\n", ["not valid YAML at line 3, column 11", "mapping values"]),
        ("- just\n- a list\n", ["expected a mapping"]),
        (SHOW_YAML + "windw: 3\n", ["unknown key(s) windw", "allowed:"]),
        (SHOW_YAML.replace("layers: 1", "layers: two"), ["layers", "'two'", "integer >= 1"]),
        (SHOW_YAML.replace("kv_heads: 1", "kv_heads: 1\nq_heads: 3").replace("kv_heads: 1", "kv_heads: 2", 1),
         ["q_heads", "multiple of kv_heads=2"]),
        (SHOW_YAML + "query_window: 9\n", ["query_window=9 needs window >= 9"]),
        (SHOW_YAML + "sizes:\n  real: {layers: 2}\n", ["no size 'small'", "real"]),
        (SHOW_YAML.replace("stream_len: [1, 1]", "stream_len: [5, 2]"), ["stream_len", "[5, 2]"]),
    ],
)
def test_bad_yaml_one_line(tmp_path, text, needles, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    code = main(["run", str(cfg), "--quiet"])
    _one_line_error(code, capsys.readouterr().err, str(cfg), *needles)


def test_bad_yaml_in_a_real_process(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("name: [unclosed\n")
    proc = flexkv("run", cfg)
    _one_line_error(proc.returncode, proc.stderr, "not valid YAML")
    assert proc.stdout == ""


def test_plot_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    code = main(["run", str(TINY), "--plot", str(tmp_path / "p.png"), "--quiet"])
    _one_line_error(code, capsys.readouterr().err, "--plot needs matplotlib", "flexkv[plot]")
    assert not (tmp_path / "p.png").exists()


def test_png_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = main(["show", "--png", str(tmp_path / "s.png")])
    captured = capsys.readouterr()
    _one_line_error(code, captured.err, "--png", "flexkv[plot]")



# ------------------------------------------------------------ shipped files

# The workload table: (layers, kv_heads, head_dim, q_heads, rows, source_len, sink, window, query_window,
# reverse, span, T, final T, final span, bias, requests) for the small size, then what the real size changes.
TABLE = {
    "streaming-llm": ((4, 8, 64, 32, 1, 0, 4, 1020, None, False, 1, 1, None, 0, "none", 32),
                      dict(layers=32, head_dim=128, window=4092, requests=64)),
    "tts-dit": ((16, 8, 64, 8, 2, 302, 100, 302, None, True, 50, 50, 54, 0, "none", 8), dict(layers=160)),
    "conformer": ((17, 8, 64, 8, 1, 0, 0, 70, None, False, 14, 14, None, 0, "relative", 32), dict(requests=128)),
    "per-query": ((8, 8, 64, 8, 1, 0, 0, 250, 249, False, 2, 2, None, 0, "none", 64), {}),
}
FIELDS = ("layers", "kv_heads", "head_dim", "q_heads", "rows", "source_len", "sink", "window",
          "query_window", "reverse", "span", "T", "final T", "final span", "bias", "requests")


def _row(w):
    return (w.layers, w.kv_heads, w.head_dim, w.num_q_heads, w.rows, w.source_len, w.sink, w.window,
            w.query_window, w.reverse_step_order, w.span, w.step_tokens, w.final_tokens, w.final_span,
            w.score_bias, w.requests)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_shipped_configs_match_the_workload_table(name):
    path = ROOT / "configs" / f"{name}.yaml"
    text = path.read_text()
    assert text.startswith(f"# {name}:") and f"flexkv run configs/{name}.yaml" in text
    small, real_changes = TABLE[name]
    w = load_workload(str(path), "small")
    assert _row(w) == small
    expect = dict(zip(FIELDS, small))
    expect.update(real_changes)
    r = load_workload(str(path), "real")
    assert _row(r) == tuple(expect[f] for f in FIELDS)
    for x in (w, r):  # streams outgrow what a slot keeps, so runs wrap the rings
        assert x.stream_len[1] > x.config().max_retained
