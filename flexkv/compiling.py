"""Running flexkv under `torch.compile`: code-object copies, graph counts, and what differs between torch releases.

flexkv supports torch 2.11 to 2.15. The APIs it uses (`flex_attention`,
`BlockMask.from_kv_blocks`, dynamo's counters and config) have the same
signatures across those releases; what differs is behaviour, and the guards
for it live here so the rest of the package reads the same on every release.
"""

from __future__ import annotations

import types
from typing import Callable, Tuple

import torch

__all__ = ["TORCH_VERSION", "SUPPORTED_TORCH", "warn_if_untested", "fresh_function", "graphs_compiled"]


def _version(text: str) -> Tuple[int, int]:
    major, minor = text.split("+")[0].split(".")[:2]
    return int(major), int(minor)


#: (major, minor) of the torch this process runs.
TORCH_VERSION = _version(torch.__version__)
#: The torch releases flexkv is tested with, inclusive (pyproject pins `torch>=2.11,<2.16`).
SUPPORTED_TORCH = ((2, 11), (2, 15))


def warn_if_untested() -> None:
    """Warn (once, at import) when this torch is outside the releases flexkv is tested with."""
    lo, hi = SUPPORTED_TORCH
    if not lo <= TORCH_VERSION <= hi:
        import warnings

        warnings.warn(
            f"flexkv is tested with torch {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}; this is torch {torch.__version__}. "
            f"Compiled FlexAttention changes between releases: run tests/test_compiled.py before relying on it",
            stacklevel=3,
        )


def fresh_function(fn: Callable, tag: str) -> Callable:
    """A copy of `fn` with its own code object.

    `torch.compile` keeps its cache of compiled graphs on the code object; a
    copy per use gives each use its own cache, so a compiled function never
    recompiles because another use of the same source was called, and never
    walks the guards of the other uses' entries.
    """
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=f"{fn.__code__.co_qualname}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def graphs_compiled() -> int:
    """Graphs torch.compile has produced in this process so far (dynamo's `unique_graphs`)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
