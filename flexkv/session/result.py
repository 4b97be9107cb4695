"""What one session step returns, cut per request: `StepResult` (`StreamSession`) and
`MultiStepResult` (`MultiCacheSession`)."""

from __future__ import annotations

from typing import Dict, Hashable, Iterator, Mapping

import torch

from .feeds import map_tensors

__all__ = ["StepResult", "MultiStepResult", "step_result"]


class _PerRequest(Mapping):
    """A step's result as a mapping of the request ids that ran to their share of the output."""

    def __init__(self, outputs, lanes: Dict, tokens: Dict, waiting: tuple, plan_s: float):
        self.outputs = outputs
        self.lanes = lanes
        self.tokens = tokens
        self.waiting = waiting
        self.plan_s = plan_s

    def _lane(self, request_id: Hashable) -> int:
        """The lane `request_id` ran on, or a `KeyError` saying why it did not run."""
        if request_id not in self.lanes:
            where = "waits for a lane" if request_id in self.waiting else "was not in this step"
            raise KeyError(f"request {request_id!r} {where}")
        return self.lanes[request_id]

    def __iter__(self) -> Iterator:
        return iter(self.lanes)

    def __len__(self) -> int:
        return len(self.lanes)

    def __repr__(self):
        return f"{type(self).__name__}(requests={list(self.lanes)}, waiting={list(self.waiting)})"


class StepResult(_PerRequest):
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
        super().__init__(outputs, lanes, tokens, waiting, plan_s)
        self.step = step
        self.plan = plan

    def __getitem__(self, request_id):
        lane, n = self._lane(request_id), self.tokens[request_id]
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


class MultiStepResult(_PerRequest):
    """What `MultiCacheSession.step` returns: each request's share of the model's output.

    `result[id]` is `fn`'s output cut to the request: when `fn` returns a
    mapping, each entry named after a cache has every tensor `[B, T_name,
    ...]` cut to `t[lane, :tokens]` (the tokens the request fed that cache),
    and every other entry is cut to its lane (`t[lane]`); any other output is
    cut to its lane. The whole batch is there too: `outputs`, `lanes`
    (id -> lane), `tokens` (id -> name -> tokens fed), `steps` and `plans`
    (name -> the `BoundedKVStep` that ran, its plan), `waiting` (ids fed this
    step that wait for a lane), `plan_s` (host seconds spent planning).
    """

    def __init__(self, outputs, lanes: Dict, tokens: Dict, steps: Dict, plans: Dict, waiting: tuple, plan_s: float):
        super().__init__(outputs, lanes, tokens, waiting, plan_s)
        self.steps = steps
        self.plans = plans

    def __getitem__(self, request_id):
        lane = self._lane(request_id)
        B = len(next(iter(self.steps.values())).segments)

        def cut(name):
            def cut_tensor(t: torch.Tensor) -> torch.Tensor:
                if t.dim() < 1 or t.shape[0] != B:
                    raise ValueError(f"an output of shape {tuple(t.shape)} is not [B={B}, ...], so it cannot be cut "
                                     f"per request; read result.outputs and result.lanes instead")
                if name is None:
                    return t[lane]
                T = self.steps[name].step_tokens
                if t.dim() < 2 or t.shape[1] != T:
                    raise ValueError(
                        f"output {name!r} (named after a cache) of shape {tuple(t.shape)} is not [B={B}, T={T}, ...] "
                        f"(cache {name!r}'s step), so it cannot be cut to the request's tokens; name it otherwise "
                        f"to have it cut to the lane only"
                    )
                return t[lane, :self.tokens[request_id][name]]
            return cut_tensor

        if isinstance(self.outputs, Mapping):
            return {k: map_tensors(cut(k if k in self.steps else None), v) for k, v in self.outputs.items()}
        return map_tensors(cut(None), self.outputs)


def step_result(one: bool, outputs, lanes: Dict, tokens: Dict, steps: Dict, plans, waiting: tuple, plan_s: float):
    """A session step's result: `tokens` (request id -> cache name -> tokens fed) and `steps` (cache name ->
    step) per cache; a `StepResult` for a session over `one` cache (named None), else a `MultiStepResult`."""
    if one:
        return StepResult(outputs, lanes, {rid: t[None] for rid, t in tokens.items()}, steps.get(None), plans,
                          waiting, plan_s)
    return MultiStepResult(outputs, lanes, tokens, steps, {} if plans is None else plans, waiting, plan_s)
