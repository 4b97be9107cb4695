"""`python -m benchmarks.report` on a small hand-made pytest-benchmark JSON."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `benchmarks` is a folder of the repository, not part of the package
    sys.path.insert(0, str(ROOT))

from benchmarks.report import collect, render, rows  # noqa: E402


def _bench(workload, impl, median, **info):
    return {"name": f"test_step[{workload}-{impl}]", "params": {"workload": workload, "impl": impl},
            "stats": {"median": median, "mean": median}, "extra_info": dict(workload=workload, impl=impl, **info)}


DATA = {
    "benchmarks": [
        _bench("streaming-llm", "flexkv", 0.040, threads=2, ratio_to_floor=2.5, gb_per_s=13.4,
               plan_fraction=0.02, compile_s=31.0, bytes_per_step=536_000_000),
        _bench("streaming-llm", "gather", 0.120),
        _bench("streaming-llm", "cat-slice", 0.100),
        _bench("streaming-llm", "unbounded", 0.500),
        _bench("streaming-llm", "floor", 0.016),
        _bench("conformer", "flexkv", 0.090, threads=2, ratio_to_floor=10.0, gb_per_s=1.0,
               plan_fraction=0.005, compile_s=20.0, bytes_per_step=90_000_000),
        _bench("conformer", "gather", 0.060),
        _bench("conformer", "floor", 0.009),
        {"name": "unrelated", "stats": {"median": 1.0}, "extra_info": {}},
    ]
}


def test_rows_compute_ratios():
    table = collect(DATA)
    assert set(table) == {"streaming-llm", "conformer"}
    by = {r["workload"]: r for r in rows(table)}
    s = by["streaming-llm"]
    assert s["best_baseline"] == "cat-slice"
    assert abs(s["speedup"] - 100 / 40) < 1e-9
    assert s["ms"]["floor"] == 16.0 and s["vs_floor"] == 2.5
    assert abs(s["plan_pct"] - 2.0) < 1e-9
    c = by["conformer"]
    assert c["best_baseline"] == "gather" and abs(c["speedup"] - 60 / 90) < 1e-9
    assert c["ms"]["unbounded"] is None


def test_render_text_and_markdown():
    text = render(DATA).splitlines()
    assert text[0].split()[:3] == ["workload", "flexkv", "ms"]
    line = next(l for l in text if l.startswith("streaming-llm"))
    assert "40.00" in line and "120.00" in line and "2.50x (cat-slice)" in line and "31.0" in line
    line = next(l for l in text if l.startswith("conformer"))
    assert "0.67x (gather)" in line and " - " in line  # no unbounded figure
    md = render(DATA, markdown=True).splitlines()
    assert md[0].startswith("| workload | flexkv ms |") and md[1].startswith("|---|")
    assert len(md) == 4


def test_script_runs_on_a_saved_file(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(DATA))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.report", str(path)], capture_output=True, text=True,
                          cwd=str(ROOT), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "2.50x (cat-slice)" in proc.stdout
    bad = tmp_path / "empty.json"
    bad.write_text(json.dumps({"benchmarks": []}))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.report", str(bad)], capture_output=True, text=True,
                          cwd=str(ROOT), timeout=120)
    assert proc.returncode == 2 and "no flexkv benchmark results" in proc.stderr
