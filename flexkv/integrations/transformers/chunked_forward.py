"""A forward compiled by hand runs its prompt as one model forward per chunk.

flexkv attends a forward of `T` tokens in chunks of at most `prefill_chunk`
(`plan.chunk_steps`). Inside one model forward every chunk of every layer is
its own stretch of the graph: a forward compiled by hand
(`model.forward = torch.compile(model.forward)`) traces a 512-token prompt
as 8 chunks x 30 layers, and inductor builds the kernels of each chunk
again, since each reads its columns at other offsets. Here the hooks call
the compiled forward once per chunk instead, each call carrying that
chunk's columns and plan (`FlexKVForward.part`): every chunk of the prompt
runs the same graph, the way a serving engine's chunked prefill does.

The chunks stay one forward: they are planned together, the streams advance
only when the last returns, and a failure in any of them takes the whole
forward back. Split only where the outputs join exactly: no padding
columns, no recurrent layers, keyword inputs the split knows (a `labels`
loss, hidden states or attentions asked for keep the single forward), and
logits either kept whole (`logits_to_keep=0`: the chunks' logits are
concatenated) or only the last few (`logits_to_keep=k` with `k` at most the
last chunk's columns, as `generate()` asks).
"""

from __future__ import annotations

from typing import Optional

import torch

from .plan import FlexKVForward, forward_compiled_by_hand

__all__ = ["chunked_call", "join_outputs"]

#: The keywords a forward may carry and still be split by columns (what `generate()` passes).
_SPLITTABLE = frozenset({"input_ids", "inputs_embeds", "attention_mask", "position_ids", "cache",
                         "past_key_values", "use_cache", "logits_to_keep", "return_dict", "flexkv_step",
                         "output_attentions", "output_hidden_states"})
#: Keywords whose value is cut to each chunk's columns (dimension 1).
_BY_COLUMN = ("input_ids", "inputs_embeds", "position_ids")


def _splits(fwd: FlexKVForward, args, kwargs) -> bool:
    if len(fwd.plans) < 2 or fwd.gather is not None or fwd.state_slots is not None or args:
        return False
    if not set(kwargs) <= _SPLITTABLE or kwargs.get("attention_mask") is not None:
        return False
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states") or kwargs.get("return_dict") is False:
        return False
    keep = kwargs.get("logits_to_keep", 0)
    return isinstance(keep, int) and 0 <= keep <= fwd.plans[-1].tokens


def chunked_call(module, fwd: FlexKVForward, args, kwargs) -> Optional[tuple]:
    """Run every chunk of `fwd` but the last through `module.forward` now, and return the `(args, kwargs)`
    of the last chunk's call (its `flexkv_step` a part whose `earlier` holds the other chunks' outputs,
    when they are kept); None where the forward is not split (see the module docstring)."""
    if torch.compiler.is_compiling() or not forward_compiled_by_hand(module) or not _splits(fwd, args, kwargs):
        return None
    keep = kwargs.get("logits_to_keep", 0)
    earlier = []
    start = 0
    for index, plan in enumerate(fwd.plans):
        stop = start + plan.tokens
        chunk = dict(kwargs)
        for name in _BY_COLUMN:
            if isinstance(kwargs.get(name), torch.Tensor):
                chunk[name] = kwargs[name][:, start:stop]
        chunk["flexkv_step"] = fwd.part(index)
        start = stop
        if index == len(fwd.plans) - 1:
            chunk["flexkv_step"].earlier = earlier
            return args, chunk
        out = module.forward(**chunk)
        fwd.context.attendance.settle()
        if keep == 0:
            earlier.append(out)
    raise AssertionError("unreachable: the loop returns at the last chunk")


def join_outputs(earlier: list, result):
    """The whole forward's output from its chunks' (`earlier`, then `result`): the per-column tensors
    (`logits`, a base model's `last_hidden_state`) concatenated; the rest is the last chunk's."""
    if not earlier or result is None:
        return result
    for name in ("logits", "last_hidden_state"):
        value = getattr(result, name, None)
        if isinstance(value, torch.Tensor):
            result[name] = torch.cat([getattr(out, name) for out in earlier] + [value], dim=1)
    return result
