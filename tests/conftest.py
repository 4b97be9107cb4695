import os
import sys
import warnings

# The cores this process may run on (as pytest-xdist's `-n auto` counts them), shared out among its workers,
# for torch's threads and for inductor's compile workers.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, _CORES // _WORKERS)))

import torch  # noqa: E402
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))
warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")

torch.set_num_threads(max(1, min(2, _CORES // _WORKERS)))

settings.register_profile(
    "flexkv",
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("flexkv")
