"""Learned attention sinks: a per-head logit that joins the softmax denominator and carries no value.

Some models (gpt-oss) give every query head `h` a learned logit `s[h]`.
Attention then normalises over the keys plus one extra cell whose score is
`s[h]` and whose value is zero:

    out = sum_j exp(x_j) v_j / (sum_j exp(x_j) + exp(s[h]))

FlexAttention returns `o = sum_j exp(x_j) v_j / sum_j exp(x_j)` and, on
request, `lse = log(sum_j exp(x_j))` (natural log). The sink only rescales
each query's output:

    out = o * Z / (Z + exp(s[h])) = o * sigmoid(lse - s[h]),   Z = exp(lse)

so the same single attention pass serves it. A query that attends nothing
(`lse = -inf`, a padding row) keeps its zero output.

FlexAttention returns that log-sum-exp when it runs eagerly and from
inductor's GPU (Triton) kernel; inductor's CPU kernel does not (torch 2.13:
"`return_lse` is not supported yet"), so on the CPU `attend` serves sinks
through `flexkv.cache.paths.row_attention`, which forms each query's log-sum-exp itself,
compiled or not.
"""

from __future__ import annotations

import torch

from ...config import resolve_device

__all__ = ["apply_learned_sinks", "check_sinks"]


def check_sinks(sinks, q_heads: int, device) -> None:
    """Raise `ValueError` unless `sinks` is a floating `[q_heads]` tensor on `device` (host-side shape check)."""
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(f"sinks must be a tensor of shape [{q_heads}] (one logit per query head), got {type(sinks).__name__}")
    if tuple(sinks.shape) != (q_heads,):
        raise ValueError(
            f"sinks must have shape [{q_heads}] (one logit per query head), got {tuple(sinks.shape)}"
        )
    if not sinks.is_floating_point():
        raise ValueError(f"sinks must be a floating-point tensor, got dtype {sinks.dtype}")
    if sinks.device != resolve_device(device):
        raise ValueError(f"sinks device expected {resolve_device(device)}, got {sinks.device}")


def apply_learned_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Rescale attention output `out [N, Hq, T, Dv]` (`Dv` the value width) for learned sink logits `sinks [Hq]`.

    `lse [N, Hq, T]` is the natural-log sum of exp of each query's attended
    scores, laid out like `out` (query head `h` of `out` is `lse[:, h]`).
    The factor is computed in at least float32 and cast to `out`'s dtype.
    """
    work = torch.promote_types(out.dtype, torch.float32)
    lse = lse.to(work)
    factor = torch.sigmoid(lse - sinks.to(work).view(1, -1, 1))
    factor = torch.where(lse == float("-inf"), torch.zeros_like(factor), factor)
    return out * factor.unsqueeze(-1).to(out.dtype)
