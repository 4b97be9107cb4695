"""One softmax over the keys of several caches: merging attention outputs by their log-sum-exp.

A query that attends two disjoint sets of keys `A` and `B` in one softmax
gets

    out = (Z_A * o_A + Z_B * o_B) / (Z_A + Z_B),   Z_X = sum_{j in X} exp(s_j)

where `o_X` is its attention over `X` alone. `attend_lse(...)`
gives `lse_X = log Z_X` with each output, so a model whose queries read
entries of two caches (a segment's left context in one and a bank of
segment summaries in another, each with its own retention) attends them
as one softmax exactly: `merge_attention((o_A, lse_A), (o_B, lse_B))`.
The merged log-sum-exp `log(Z_A + Z_B)` comes back too, so more parts can
be merged later. A query that reads nothing in one part (`lse = -inf`) takes
the other part as it is; one that reads nothing anywhere gets zeros and
`-inf`, as `attend` gives.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["merge_attention"]


def merge_attention(*parts: Tuple[torch.Tensor, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """`(out [..., Q, Dv], lse [..., Q])` of one softmax over the union of the parts' disjoint key sets.

    Each part is `(out, lse)` as `attend_lse(...)` returns it: outputs of one shape and
    dtype, log-sum-exps of that shape less the last axis. The weights are formed in at least float32;
    the output keeps the parts' dtype and the log-sum-exp is at least float32. Traceable by
    `torch.compile(fullgraph=True)`.
    """
    if not parts:
        raise ValueError("merge_attention: give at least one (out, lse) pair")
    for i, part in enumerate(parts):
        if not (isinstance(part, tuple) and len(part) == 2):
            raise ValueError(f"merge_attention: part {i} must be an (out, lse) pair as attend_lse(...) "
                             f"returns it, got {type(part).__name__}")
    out0 = parts[0][0]
    for i, (out, lse) in enumerate(parts):
        if out.shape != out0.shape or out.dtype != out0.dtype:
            raise ValueError(f"merge_attention: part {i}'s output is {tuple(out.shape)} {out.dtype}, part 0's "
                             f"{tuple(out0.shape)} {out0.dtype}; every part must attend the same queries")
        if lse.shape != out.shape[:-1]:
            raise ValueError(f"merge_attention: part {i}'s log-sum-exp must be {tuple(out.shape[:-1])} (its output "
                             f"less the last axis), got {tuple(lse.shape)}")
    work = torch.promote_types(out0.dtype, torch.float32)
    lses = torch.stack([lse.to(work) for _, lse in parts])
    top = lses.amax(dim=0)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    weights = torch.exp(lses - top)  # 0 for a part that reads nothing
    total = weights.sum(dim=0)
    merged = sum(w.unsqueeze(-1) * out.to(work) for w, (out, _) in zip(weights, parts))
    merged = merged / total.clamp_min(torch.finfo(work).tiny).unsqueeze(-1)
    return merged.to(out0.dtype), top + torch.log(total)
