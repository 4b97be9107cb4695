"""One planned forward through a `FlexKVCache`: its chunks (`chunk_steps`), `FlexKVForward`, `Pending`.

`FlexKVCache.prepare` plans a forward on the host: the flexkv steps of its
chunks, their plans, how the forward's columns map to stream tokens, the
stream positions, and (for models with recurrent layers) which slot each
row's state lives in. The model's layers read all of it from the forward's
`flexkv_step` keyword; nothing in a stream changes until the forward returns
and the cache commits it.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch

from ...step import BoundedKVStep, Segment, StreamPosition

__all__ = ["FlexKVForward", "Pending", "chunk_steps", "compiled_forward", "forward_columns", "real_columns"]

_SOFTCAP_MODS: dict = {}


def softcap_mod(cap: float):
    """`score_mod` capping a scaled score at `cap` as Gemma 2 does: `cap * tanh(score / cap)`."""
    cap = float(cap)
    mod = _SOFTCAP_MODS.get(cap)
    if mod is None:

        def mod(score, b, h, q_pos, kv_pos):
            return torch.tanh(score / cap) * cap

        _SOFTCAP_MODS[cap] = mod
    return mod


def compiled_forward(model) -> bool:
    """Whether `model`'s forward may run under `torch.compile`: planned while tracing, the module
    compiled (`model.compile()`), its `forward` replaced by a compiled one (the model's or its
    base model's), or its `__call__` compiled by transformers' `generate(compile_config=...)`
    (`_compiled_call`). A forward that may is given plans whose parts are made before the graph."""
    if torch.compiler.is_compiling():
        return True
    return model is not None and (forward_compiled_by_hand(model) or any(
        d.get("_compiled_call_impl") is not None or d.get("_compiled_call") is not None for d in _own_dicts(model)))


def forward_compiled_by_hand(model) -> bool:
    """Whether `model`'s `forward` (or its base model's) was replaced by a compiled one
    (`model.forward = torch.compile(model.forward)`), the hooks then running outside the graph."""
    return any(hasattr(d.get("forward"), "_torchdynamo_orig_callable") for d in _own_dicts(model))


def _own_dicts(model) -> list:
    """The instance dicts of `model` and its base model: read directly, since a module's attribute lookup is
    slow and these are read per forward."""
    base = model._modules.get(getattr(type(model), "base_model_prefix", None) or "")
    return [mod.__dict__ for mod in (model, base) if mod is not None]


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`x[b, :, index[b, t], :]` for `x [B, H, T, D]`, `index [B, T']` -> `[B, H, T', D]`."""
    B, H, _, D = x.shape
    return x.gather(2, index[:, None, :, None].expand(B, H, index.shape[1], D))


class FlexKVForward:
    """One planned forward pass: the plan of each chunk and how columns map to stream tokens.

    Made by `FlexKVCache.prepare` on the host and handed to every layer
    through the forward's `flexkv_step` keyword. Its tensors are on the
    cache's device; `attend` reads nothing but tensors, so a compiled forward
    sees a new `FlexKVForward` every step without recompiling.
    """

    def __init__(self, cache, steps, plans, gather, scatter, position_ids, state_slots=None, continues=False):
        self.cache = cache
        #: the cache's `flexkv.model.step_context.StepContext`: the forward's step (its transaction and attendance
        #: check), and every attention call of it
        self.context = cache.context
        #: the flexkv steps of the forward's chunks, committed when the forward returns
        self.steps = tuple(steps)
        #: one plan per chunk (the context's bound group of plans)
        self.plans = tuple(plans)
        #: `[B, T']` column of each stream token (None: every column is a token)
        self.gather = gather
        #: `[B, T]` index into the `T' + 1` outputs for each column (`T'`: zeros)
        self.scatter = scatter
        #: `[B, T]` the stream position of each column
        self.position_ids = position_ids
        #: "cache" positions: rewrites the sink cells per layer (`CachePositions`)
        self.rotary = cache.cache_positions
        #: per chunk, whether its queries share one eviction count ("cache" positions; else each query reads
        #: the sinks at its own offset, `CachePositions.attend_per_query`)
        self.rotary_shared = tuple(True if self.rotary is None else self.rotary.shares_eviction(s) for s in steps)
        #: model layer -> the KV layer it attends in the cache
        self.kv_layer = cache.kv_layer
        #: `[B]` the state slot of each row (models with recurrent layers; else None)
        self.state_slots = state_slots
        #: whether any row's stream has written tokens before this forward (its state is read)
        self.continues = continues
        #: the recurrent states this forward produced, committed to their slots when it returns
        self.staged: dict = {}
        #: the model module whose hooks planned the forward (None: planned by hand)
        self.owner = None
        #: a part (`part`): the whole forward it belongs to and its chunk's index (None: the whole)
        self.whole = None
        self.index = None

    def part(self, index: int) -> "FlexKVForward":
        """Chunk `index` of this forward alone, for a model forward that runs that chunk's columns only
        (`chunked_forward`): it attends `plans[index]`, and its `whole` is this forward, which is what is
        committed or rolled back. Only for a forward without padding columns or recurrent state."""
        if self.gather is not None or self.state_slots is not None or self.whole is not None:
            raise ValueError("FlexKVForward.part: a forward with padding columns or recurrent layers runs its "
                             "chunks inside one model forward")
        start = sum(plan.tokens for plan in self.plans[:index])
        part = copy.copy(self)
        part.plans = (self.plans[index],)
        # Every part of a forward whose chunks do not all share one eviction count attends per query (the
        # same result where a chunk's queries do share one): the parts then run one graph, not two.
        part.rotary_shared = (all(self.rotary_shared),)
        part.position_ids = self.position_ids[:, start:start + self.plans[index].tokens]
        part.whole, part.index = self, index
        #: the outputs of the chunks before, where the whole forward's output joins them (`chunked_forward`)
        part.earlier = []
        return part

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale=None,
        *,
        softcap: Optional[float] = None,
        sinks: Optional[torch.Tensor] = None,
        sliding_window: Optional[int] = None,
    ) -> torch.Tensor:
        """Attend model layer `layer_idx` for the whole forward: `q [B, Hq, T, D]`, `k [B, Hkv, T, D]`,
        `v [B, Hkv, T, Dv]` in, `[B, Hq, T, Dv]` out. Each chunk is one call of the context's `attend`
        (which counts it for the forward's attendance check)."""
        self.cache.check_layer(layer_idx, sliding_window, softcap)
        if not torch.compiler.is_compiling():
            self.cache.note_eager_attention()
        kv = self.kv_layer[layer_idx]
        score_mod = None if softcap is None else softcap_mod(softcap)
        if self.gather is not None:
            q, k, v = take(q, self.gather), take(k, self.gather), take(v, self.gather)
        outs = []
        start = 0
        single = len(self.plans) == 1 and self.plans[0].tokens == q.shape[2]
        for index, plan in enumerate(self.plans):
            if single:
                qc, kc, vc = q, k, v
            else:
                stop = start + plan.tokens
                qc, kc, vc = q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop]
                start = stop
            if self.rotary is not None:
                if not self.rotary_shared[index]:
                    out = self.rotary.attend_per_query(self.context, layer_idx, kv, qc, kc, vc, plan, scale=scale,
                                                       score_mod=score_mod, sinks=sinks)
                    if out is not None:
                        outs.append(out)
                        continue
                qc, kc = self.rotary(kv, qc, kc, plan)
            outs.append(self.context.attend(layer_idx, qc, kc, vc, plan=plan, scale=scale, score_mod=score_mod,
                                            sinks=sinks))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        if self.scatter is not None:
            out = take(torch.cat([out, out.new_zeros(out.shape[0], out.shape[1], 1, out.shape[3])], dim=2), self.scatter)
        return out


class Pending:
    """A planned forward not yet committed: the cache's context holds its step, which undoes it if it fails."""

    def __init__(self, forward: FlexKVForward, state):
        self.forward = forward
        #: the model's hook state whose attention switch this forward turned on (`hooks.ModelState`)
        self.state = state


def chunk_steps(rows, written, lengths, chunk: int) -> list:
    """The flexkv steps of one forward: its columns in chunks of at most `chunk` tokens per row.

    `rows`: each batch row's stream id, `written` its length before the forward, `lengths` its new
    tokens. Each step continues every stream where the chunk before left it (planned at the positions
    it will have).
    """
    longest = max(lengths)
    steps = []
    start = 0
    while start < longest or not steps:
        tokens = max(1, min(chunk, longest - start))
        spans = [max(0, min(tokens, L - start)) for L in lengths]
        steps.append(
            BoundedKVStep(
                segments=tuple(Segment(sid, s) for sid, s in zip(rows, spans)),
                positions={sid: StreamPosition(0, w + min(start, L)) for sid, w, L in zip(rows, written, lengths)},
                tokens=tokens,
            )
        )
        start += tokens
    return steps


def real_columns(attention_mask, B: int, T: int):
    """Each row's token columns among a forward's last `T` (None: no padding), from a 2-D padding mask."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ValueError(
            "FlexKVCache takes a 2-D padding attention_mask [batch, columns] (ones: tokens, zeros: padding); "
            f"got {type(attention_mask).__name__} of shape "
            f"{tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else None}. "
            "flexkv builds the attention pattern itself"
        )
    if attention_mask.shape[0] != B or attention_mask.shape[1] < T:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not cover the forward's "
            f"{B} rows x {T} tokens"
        )
    # The one device read of the integration: which of this forward's columns are padding
    # (read as Python values: a nonzero entry is a token, as `.bool()` would say).
    flags = attention_mask[:, -T:].tolist()
    if all(all(r) for r in flags):
        return None
    return [[t for t, f in enumerate(r) if f] for r in flags]


def forward_columns(real, written, T: int) -> tuple:
    """`(gather, scatter, positions)` as host lists: where each row's tokens sit among its `T` columns (None
    without padding, `real` None) and each column's stream position, the rows holding `written` tokens."""
    gather = scatter = None
    if real is not None:
        longest = max(len(r) for r in real)
        gather, scatter = [], []
        for r in real:
            gather.append(r + [r[-1] if r else 0] * (longest - len(r)))
            rank = {col: i for i, col in enumerate(r)}
            scatter.append([rank.get(col, longest) for col in range(T)])
    pos = []
    for b, w in enumerate(written):
        if real is None:
            pos.append(list(range(w, w + T)))
        else:
            rank = {col: i for i, col in enumerate(real[b])}
            pos.append([w + rank.get(col, 0) for col in range(T)])
    return gather, scatter, pos
