"""Running flexkv under `torch.compile`: the torch release, code-object copies, graph counts, recompiles.

flexkv supports torch 2.11 to 2.15 (`SUPPORTED_TORCH`; `TORCH_VERSION` is
the running one, `warn_if_untested` says when it is outside). The APIs it
uses have the same signatures across those releases; where their behaviour
differs, the code that depends on it decides at its own site (the kernel
paths in `flexkv.cache.manager`, `kernel_sharing` and `kernel_options`,
learned sinks in `flexkv.cache.paths.sinks`). `fresh_function` gives a compiled
use a code object (and so a graph cache) of its own, `graphs_compiled`
counts graphs, and `watch_recompiles` turns a recompile after warm-up into
a warning, or an error at dynamo's limit, that names the guard that failed.
"""

from __future__ import annotations

import contextlib
import types
import warnings
from typing import Callable, Iterator, List, Tuple

import torch

__all__ = ["TORCH_VERSION", "SUPPORTED_TORCH", "warn_if_untested", "fresh_function", "graphs_compiled",
           "recompile_reasons", "watch_recompiles", "RecompileWarning", "RecompileError"]


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


class RecompileWarning(UserWarning):
    """A compiled step that was warmed up compiled again: the message says which guard failed."""


class RecompileError(RuntimeError):
    """A compiled step recompiled until torch.compile gave up: the message says which guard failed."""


def recompile_reasons(code: types.CodeType) -> List[str]:
    """Why dynamo recompiled the function whose code object is `code`, oldest first.

    Dynamo records a guard-failure reason for every cached graph it checked
    before compiling anew (`torch._dynamo.utils.guard_failures`, the record
    `TORCH_LOGS=recompiles` prints from); at recompile `k` the graph compiled
    last comes first. Empty where this torch keeps no such record.
    """
    try:
        from torch._dynamo.utils import guard_failures
    except ImportError:  # pragma: no cover - every supported release has it
        return []
    return list(guard_failures.get(code, ()))


def _limit_hit_type():
    exc = getattr(torch._dynamo, "exc", None)
    return getattr(exc, "FailOnRecompileLimitHit", None) if exc is not None else None


@contextlib.contextmanager
def watch_recompiles(code: types.CodeType, where: str, advice: str, stacklevel: int = 3) -> Iterator[None]:
    """Run a call of a warmed-up compiled function (code object `code`) and explain any recompile.

    A recompile during the call gives a `RecompileWarning` naming the guard
    that failed (`where` says what was compiled, `advice` what to do); when
    dynamo gives up (`FailOnRecompileLimitHit`, as a `fullgraph=True` function
    does at `torch._dynamo.config.recompile_limit`), a `RecompileError` with
    the same explanation replaces dynamo's bare one. `stacklevel` points the
    warning at the caller's frame, counted from this generator's.
    """
    before = len(recompile_reasons(code))
    limit_hit = _limit_hit_type()

    def explain(head: str) -> str:
        new = recompile_reasons(code)[before:]
        reason = new[0] if new else "dynamo recorded no reason (TORCH_LOGS=recompiles prints them)"
        return f"{where} {head}. The guard that failed against the graph compiled last:\n    {reason}\n{advice}"

    try:
        yield
    except Exception as exc:
        if limit_hit is not None and isinstance(exc, limit_hit):
            raise RecompileError(explain(
                f"recompiled after warm-up until torch.compile gave up "
                f"(torch._dynamo.config.recompile_limit={torch._dynamo.config.recompile_limit})")) from exc
        raise
    if len(recompile_reasons(code)) > before:
        warnings.warn(explain("recompiled after warm-up"), RecompileWarning, stacklevel=stacklevel)
