"""`StepResult`: what one session step returns, cut per request."""

from __future__ import annotations

from typing import Dict, Iterator, Mapping

import torch

from .feeds import map_tensors

__all__ = ["StepResult"]


class StepResult(Mapping):
    """What `StreamSession.step` returns: each request's share of the model's output.

    `result[rid]` is `fn`'s output with every tensor `[B, T, ...]` cut to the
    request's lane and its own tokens: `t[lane, :n]`. The whole batch is
    there too:

    - `outputs`: `fn`'s output as it returned it (padded lanes included);
    - `lanes`: request id -> lane (batch row; rows `lane * R .. lane * R + R - 1`
      of the attention with `rows_per_request = R`);
    - `tokens`: request id -> how many tokens it fed;
    - `step`: the `BoundedKVStep` that ran (its positions are before the step);
    - `plan`: the step's plan (what the cache's `plan` returned);
    - `waiting`: request ids fed this step that wait for a lane (not run);
    - `plan_s`: host seconds spent planning the step (building it from the requests' positions, the
      cache's checks and its plan; not starting new requests or warming up).
    """

    def __init__(self, outputs, lanes: Dict, tokens: Dict, step, plan, waiting: tuple, plan_s: float):
        self.outputs = outputs
        self.lanes = lanes
        self.tokens = tokens
        self.step = step
        self.plan = plan
        self.waiting = waiting
        self.plan_s = plan_s

    def __getitem__(self, request_id):
        if request_id not in self.lanes:
            where = "waits for a lane" if request_id in self.waiting else "was not in this step"
            raise KeyError(f"request {request_id!r} {where}")
        lane, n = self.lanes[request_id], self.tokens[request_id]
        T = self.step.step_tokens
        B = len(self.step.segments)

        def cut(t: torch.Tensor) -> torch.Tensor:
            if t.dim() < 2 or t.shape[0] != B or t.shape[1] != T:
                raise ValueError(
                    f"an output of shape {tuple(t.shape)} is not [B={B}, T={T}, ...], so it cannot be cut per "
                    f"request; read result.outputs and result.lanes instead"
                )
            return t[lane, :n]

        return map_tensors(cut, self.outputs)

    def __iter__(self) -> Iterator:
        return iter(self.lanes)

    def __len__(self) -> int:
        return len(self.lanes)

    def __repr__(self):
        return f"StepResult(requests={list(self.lanes)}, waiting={list(self.waiting)})"
