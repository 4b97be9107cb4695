import os
import sys
import warnings

import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))
warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

settings.register_profile(
    "flexkv",
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("flexkv")
