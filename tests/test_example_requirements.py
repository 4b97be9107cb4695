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
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert ("examples/emformer_memory_bank.py runs torchaudio's Emformer, and torchaudio cannot be imported"
            in out.stderr), out.stderr
    assert f"pip install 'torchaudio=={release}.*'" in out.stderr, out.stderr
