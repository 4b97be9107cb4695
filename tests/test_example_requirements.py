"""An example that needs a package flexkv does not depend on says what to install when it is missing."""

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

#: Run in a fresh interpreter: hide torchaudio (as a plain flexkv install has it), then run the example.
_WITHOUT_TORCHAUDIO = """
import runpy, sys
sys.modules["torchaudio"] = None  # `import torchaudio...` now raises ModuleNotFoundError
sys.argv = [sys.argv[1], "--segments", "1"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_the_emformer_example_without_torchaudio_says_what_to_install():
    example = ROOT / "examples" / "emformer_memory_bank.py"
    out = subprocess.run([sys.executable, "-c", _WITHOUT_TORCHAUDIO, str(example)], capture_output=True,
                         text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert ("examples/emformer_memory_bank.py runs torchaudio's Emformer, and torchaudio cannot be imported"
            in out.stderr), out.stderr
    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if release <= (2, 11):  # torchaudio's last release
        assert f"pip install 'torchaudio=={release[0]}.{release[1]}.*'" in out.stderr, out.stderr
    else:
        assert "pip install 'torch==2.11.*' 'torchaudio==2.11.*'" in out.stderr, out.stderr


def test_the_hint_names_a_torchaudio_that_exists():
    """torchaudio 2.11 is the last release: torch 2.11 gets it, torch 2.13 is told to run beside torch 2.11."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("emformer_example", ROOT / "examples" / "emformer_memory_bank.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.torchaudio_hint("2.11.0+cu130").endswith("pip install 'torchaudio==2.11.*'")
    assert "'torch==2.11.*' 'torchaudio==2.11.*'" in mod.torchaudio_hint("2.13.0+cpu")
