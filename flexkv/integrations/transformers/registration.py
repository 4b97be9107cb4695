"""The supported transformers releases, and the `"flexkv"` attention function registered with them.

Importing this module checks the installed transformers release first
(`import_transformers`): any release outside `SUPPORTED_TRANSFORMERS` fails
with one message that says what to install, before anything else of
transformers is imported.
"""

from __future__ import annotations

import re
import sys
from typing import Optional

import torch

__all__ = ["ATTN_IMPLEMENTATION", "SUPPORTED_TRANSFORMERS", "UnplannedAttention", "flexkv_attention_forward",
           "import_transformers", "register", "release_compile_globals"]

#: The transformers releases this integration is tested with: `>= lo, < hi`.
SUPPORTED_TRANSFORMERS = ("5.23", "5.26")
#: The name the attention function is registered under.
ATTN_IMPLEMENTATION = "flexkv"


def _version_tuple(text: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:2])


def import_transformers():
    """Import transformers, or fail with one message naming the supported range."""
    lo, hi = SUPPORTED_TRANSFORMERS
    hint = (
        f"flexkv.integrations.transformers needs transformers>={lo},<{hi}; "
        f"install it with: pip install 'flexkv[transformers]'"
    )
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(f"{hint} (transformers is not installed)") from exc
    found = transformers.__version__
    if not _version_tuple(lo) <= _version_tuple(found) < _version_tuple(hi):
        raise ImportError(f"{hint} (found transformers {found})")
    return transformers


import_transformers()

#: transformers' (and the `kernels` package's) context variables that act as a plain global while a
#: forward is compiled: `(module, attribute)`, read only where the module is already imported.
_COMPILE_CONTEXT_VARS = (("transformers.utils.output_capturing", "_active_collector"),
                         ("kernels._internals.layer.layer", "_ACTIVE_KERNEL_FUNCS"))


def release_compile_globals() -> None:
    """Clear what a compiled forward left set in transformers' compile-time globals
    (`TORCH_WORKAROUNDS["FINALLY_AFTER_HOP"]`).

    transformers sets such a global before running a layer and clears it in a `finally` block; a
    compiled forward through flexkv's attention (a higher-order op) keeps the set and drops the
    clear. Left alone, the next eager forward reads the stale global (with `output_hidden_states=True`
    it returns no hidden states) and, where the `kernels` package decorates the attention class
    (transformers 5.25), the next compiled forward compiles a second graph. Called when a forward's
    plan ends, outside any compiled frame (it does nothing while compiling).
    """
    if torch.compiler.is_compiling():
        return
    for module, name in _COMPILE_CONTEXT_VARS:
        var = getattr(sys.modules.get(module), name, None)
        if var is None or not hasattr(var, "global_var"):
            continue
        var.global_var = None
        for flag in ("compiling", "uses_global_var"):  # transformers' name for the switch, then kernels'
            if hasattr(var, flag):
                setattr(var, flag, False)

from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402


class UnplannedAttention(ValueError):
    """The `"flexkv"` attention ran without a plan (`flexkv_step`): no FlexKVCache planned the forward,
    or the model's layers do not hand the forward's keywords down to their attention.

    `where`: the attention module's class name and layer index.
    """

    def __init__(self, message: str, where: str = ""):
        super().__init__(message)
        self.where = where


def flexkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    flexkv_step=None,
    **kwargs,
):
    """The `"flexkv"` attention function (transformers' `AttentionInterface` signature).

    `query [B, Hq, T, D]`, `key [B, Hkv, T, D]`, `value [B, Hkv, T, Dv]` (the
    step's own tokens, already rotated). Returns `([B, T, Hq, Dv], None)`.
    The model passes `softcap` (Gemma 2), `s_aux` (gpt-oss's learned sinks)
    and its layer's `sliding_window`; all three are honoured. It runs only
    inside a forward planned by a `FlexKVCache` (`flexkv_step`, a
    `FlexKVForward`), which switches the model to it for that forward.
    """
    if flexkv_step is None:
        where = f"{type(module).__name__}, layer {getattr(module, 'layer_idx', None)}"
        raise UnplannedAttention(
            f"the {ATTN_IMPLEMENTATION!r} attention ran in a forward no FlexKVCache planned "
            f"({where}): a FlexKVCache switches the model "
            f"to it for the forwards it plans and back afterwards; do not set attn_implementation="
            f"{ATTN_IMPLEMENTATION!r} yourself, and after cache.prepare() call cache.commit() or cache.rollback()", where
        )
    if module.training and dropout > 0:
        raise ValueError(
            f"flexkv attention is for inference: got dropout={dropout} in training mode; call model.eval()"
        )
    out = flexkv_step.attend(
        module.layer_idx, query, key, value, scaling,
        softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux"), sliding_window=kwargs.get("sliding_window"),
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register `flexkv_attention_forward` (and a mask function for it) with transformers."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, flexkv_attention_forward)
    # The mask transformers builds inside a planned forward is not read (flexkv masks itself);
    # SDPA's mask function builds a valid one for any model.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
