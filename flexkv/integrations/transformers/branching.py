"""Streams that branch and take tokens back inside `generate()`: beam search, assisted decoding, many samples.

A bounded stream is small and fixed, so it can be copied and, within the
cache's spare ring cells, shortened (docs/contract.md section 5, "Fork and
roll back"). `BranchingCache` gives a `FlexKVCache` transformers' cache
methods for that, mapped onto the core's operations:

* `reorder_cache(beam_idx)` (beam search): row `i` continues row
  `beam_idx[i]`'s stream, one batched copy (`reorder_requests`);
* `crop(-n)` (assisted generation, prompt lookup): every selected stream
  takes back its last `n` tokens (`rollback_request`);
* `batch_repeat_interleave(k)`: every row's stream is forked `k - 1` times;
* `batch_select_indices(indices)`: the rows kept, the other streams ended;

and the flexkv names `fork_stream`, `reorder_streams` and `rollback_stream`.
Recurrent states are copied with their slots; they cannot be taken back, so
a cache with recurrent layers refuses `crop`.

`generate_branching` runs under the model's `generate()` guard: a call
that repeats each prompt (`num_beams`, `num_return_sequences`) prefills every
prompt once and forks its stream, and a call that raises leaves every stream
as it was before it (or, where a stream moved further than its slot can
take back, says so on the error).
"""

from __future__ import annotations

from typing import Hashable, List

import torch

from ...cache.host.slots import SlotsExhausted
from ...cache.storage.slot_copy import SlotBuffer, copy_slots

__all__ = ["BranchingCache", "generate_branching", "expansion"]


class BranchingCache:
    """Fork, reorder and roll back for `FlexKVCache` (a mixin before `CacheShim`)."""

    # --------------------------------------------------------------- helpers

    def _state_buffers(self):
        if self._recurrent is None:
            return []
        return [SlotBuffer(buf, 0, 0, 1) for buf in self._recurrent.buffers.values()]

    def _slot(self, stream_id) -> int:
        return self.manager.slot_of(stream_id)

    def _branching(self, what: str) -> None:
        self.recover_forward()
        self._no_pending(what)

    # ------------------------------------------------------------ flexkv names

    def fork_stream(self, stream_id: Hashable, new_id: Hashable) -> None:
        """Start stream `new_id` as a copy of `stream_id` (its cells, length and recurrent states);
        atomic. `new_id` must be a new id and a slot must be free."""
        self._branching("fork_stream()")
        if stream_id not in self.manager.requests:
            raise ValueError(f"fork_stream(): no stream {stream_id!r}; the cache holds {list(self.manager.requests)}")
        self.manager.fork_request(stream_id, new_id)
        try:
            copy_slots(self._state_buffers(), [(self._slot(stream_id), self._slot(new_id))])
        except BaseException:
            self.manager.remove_request(new_id)
            raise

    def reorder_streams(self, mapping) -> None:
        """`{destination: source}`: every destination stream continues its source stream as it was
        before the call (cells, length, recurrent states), in one batched copy; atomic."""
        self._branching("reorder_streams()")
        mapping = dict(mapping)
        self.manager.check_reorder(mapping)
        pairs = [(self._slot(src), self._slot(dst)) for dst, src in mapping.items() if dst != src]
        copy_slots(self._state_buffers(), pairs)
        self.manager.reorder_requests(mapping)

    def rollback_stream(self, stream_id: Hashable, tokens: int) -> None:
        """Take back the last `tokens` tokens of a stream (see `BoundedKVManager.rollback_request`);
        refused, changing nothing, beyond what the slot can take back (`max_rollback`) and for a
        model with recurrent layers."""
        self._branching("rollback_stream()")
        self._rollback([stream_id], tokens, "rollback_stream()")

    def _rollback(self, streams, tokens: int, what: str) -> None:
        if tokens and self._recurrent is not None:
            raise ValueError(
                f"{what}: this model's recurrent layers {list(self._recurrent.layers)} keep one state per stream that "
                f"has taken in every token; it cannot be taken back, so a stream cannot be shortened"
            )
        for sid in streams:
            if sid not in self.manager.requests:
                raise ValueError(f"{what}: no stream {sid!r}; the cache holds {list(self.manager.requests)}")
            try:
                self.manager.check_rollback(sid, tokens)
            except ValueError as exc:
                raise ValueError(
                    f"{what}: stream {sid!r}: {exc}. With a FlexKVCache: FlexKVCache(model, ..., max_rollback=N) "
                    f"with N at least the draft tokens a verification takes back (assisted generation drafts up to "
                    f"the assistant's generation_config.num_assistant_tokens, which its heuristic schedule raises)"
                ) from None
        for sid in streams:
            self.manager.rollback_request(sid, tokens)

    # ------------------------------------------------------- transformers' API

    def _rows_now(self, what: str) -> tuple:
        rows = self.selected.streams
        if rows is None:
            raise ValueError(f"{what}: no forward has run through this cache yet, so it has no rows")
        return rows

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: batch row `i` continues the stream of row `beam_idx[i]` (reads `beam_idx` on the host)."""
        self._branching("reorder_cache()")
        rows = self._rows_now("reorder_cache()")
        order = [int(i) for i in (beam_idx.tolist() if isinstance(beam_idx, torch.Tensor) else beam_idx)]
        if len(order) != len(rows) or any(not 0 <= i < len(rows) for i in order):
            raise ValueError(f"reorder_cache(): beam_idx must name one of the {len(rows)} rows for each row, got {order}")
        self.reorder_streams({rows[i]: rows[j] for i, j in enumerate(order)})

    def crop(self, tokens_to_remove: int) -> None:
        """Take back the last `-tokens_to_remove` tokens of every selected stream (assisted decoding's
        rejected draft); a positive value keeps that many of the columns fed since `select()`."""
        self._branching("crop()")
        rows = self._rows_now("crop()")
        n = int(tokens_to_remove)
        fed = self.selected.columns
        n = -n if n <= 0 else fed - n
        if not 0 <= n <= fed:
            raise ValueError(
                f"crop({tokens_to_remove}): the streams took in {fed} columns since select(); "
                f"cannot take back {n}"
            )
        self._rollback(rows, n, "crop()")
        self.selected.take_back(n)

    @property
    def is_croppable(self) -> bool:
        """Whether `crop` can take tokens back: not with recurrent layers (their state cannot)."""
        return self._recurrent is None

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Every row's stream forked `repeats - 1` times, the copies of row `s` named `(s, 1)`, ...,
        right after it in the selection (atomic)."""
        self._branching("batch_repeat_interleave()")
        rows = self._rows_now("batch_repeat_interleave()")
        k = int(repeats)
        if k < 1:
            raise ValueError(f"batch_repeat_interleave(): repeats must be >= 1, got {repeats!r}")
        self._select_forks([(sid, [(sid, j) for j in range(1, k)]) for sid in rows])

    def batch_select_indices(self, indices) -> None:
        """Keep the rows at `indices` (distinct); the streams of the other rows are ended."""
        self._branching("batch_select_indices()")
        rows = self._rows_now("batch_select_indices()")
        keep = [int(i) for i in (indices.tolist() if isinstance(indices, torch.Tensor) else indices)]
        if len(set(keep)) != len(keep) or any(not 0 <= i < len(rows) for i in keep):
            raise ValueError(f"batch_select_indices(): indices must be distinct rows of {len(rows)}, got {keep}")
        for i, sid in enumerate(rows):
            if i not in keep:
                self.manager.remove_request(sid)
        self.selected.regroup(tuple(rows[i] for i in keep))

    def _check_fork_room(self, plan, opening=()) -> None:
        """Refuse, changing nothing, unless the free slots hold the streams of `opening` not open yet
        and every copy of `plan` (`[(stream, [its copies])]`; a copy that replaces a stream of its name
        reuses that stream's slot)."""
        new = [c for _, copies in plan for c in copies]
        stale = [c for c in new if c in self.manager.requests]
        starting = [s for s in opening if s not in self.manager.requests]
        free = self.manager.free_slots
        need = len(starting) + len(new) - len(stale)
        if need > free:
            what = f"{len(new)} stream copies" + (f" and {len(starting)} new streams" if starting else "")
            raise SlotsExhausted(
                f"{what} need {need} free slots but {free} are free (max_streams={self.manager.config.max_slots}); "
                f"build the cache with max_streams at least the batch size times the copies per prompt, or "
                f"finish() streams you no longer need"
            )

    def _select_forks(self, plan) -> None:
        """`plan`: `[(stream, [its copies])]` in row order: fork every copy (replacing a stream of the
        same name that holds tokens from earlier), then select them all; on any error no copy is left."""
        self._check_fork_room(plan)
        new = [c for _, copies in plan for c in copies]
        stale = [c for c in new if c in self.manager.requests]
        for c in stale:
            self.manager.remove_request(c)
        made: List[Hashable] = []
        try:
            for sid, copies in plan:
                for c in copies:
                    self.fork_stream(sid, c)
                    made.append(c)
        except BaseException:
            for c in made:
                self.manager.remove_request(c)
            raise
        self.selected.regroup(tuple(x for sid, copies in plan for x in (sid, *copies)))


# ----------------------------------------------------------------- generate()


def expansion(mode: str, config) -> int:
    """How many rows `generate()` makes of each prompt in `mode` (transformers repeats the prompt)."""
    if mode in ("beam_search", "beam_sample"):
        return int(config.num_beams or 1)
    return int(config.num_return_sequences or 1)


def _input_ids(args, kwargs):
    ids = kwargs.get("input_ids", kwargs.get("inputs"))
    if ids is None and args:
        ids = args[0]
    return ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


def _snapshot(cache) -> dict:
    return {sid: cache.manager.written(sid) for sid in cache.manager.requests}


def _restore(cache, before: dict, saved: tuple, exc: BaseException) -> None:
    """Return every stream to its length before the call; say on `exc` which could not be."""
    cache.recover_forward()
    if cache.pending_forward is not None:
        cache.rollback()
    stuck = []
    for sid in list(cache.manager.requests):
        if sid not in before:
            cache.manager.remove_request(sid)
            continue
        extra = cache.manager.written(sid) - before[sid]
        if extra == 0:
            continue
        try:
            cache._rollback([sid], extra, "generate()")
        except ValueError:
            stuck.append((sid, extra))
    cache.selected.restore(saved)
    if stuck and hasattr(exc, "add_note"):
        exc.add_note(
            "flexkv: generate() failed after these streams took in tokens that their slots cannot take back "
            + ", ".join(f"{sid!r} (+{n})" for sid, n in stuck)
            + "; they stay longer than before the call (cache.stream_length() says how long): finish() them and "
            "start again, or continue them from where they are"
        )


def generate_branching(cache, model, generate, mode: str, config, args, kwargs):
    """Run `generate(*args, **kwargs)` over `cache` (already checked by the guard): prompts that
    `generate()` repeats are prefilled once and forked, and a failure restores the streams."""
    before, saved = _snapshot(cache), cache.selected.save()
    try:
        k = expansion(mode, config)
        ids = _input_ids(args, kwargs)
        if k > 1 and ids is not None and ids.shape[1] > 1 and kwargs.get("inputs_embeds") is None:
            kwargs = _prefill_once(cache, model, ids, k, args, kwargs)
        return generate(*args, **kwargs)
    except BaseException as exc:
        _restore(cache, before, saved, exc)
        raise


def _prefill_once(cache, model, ids: torch.Tensor, k: int, args, kwargs) -> dict:
    """Feed all but the last token of every prompt once, fork each stream into the `k` rows that
    `generate()` makes of it, and leave `get_seq_length()` at the prompt's length minus one, so the
    first forward of `generate()` feeds only the last token of each row."""
    B, P = ids.shape
    rows = cache.selected.streams
    if rows is None:
        # Unselected, row r of the expanded batch is stream r: prompt b's rows are b*k .. b*k + k - 1.
        streams = [b * k for b in range(B)]
        copies = [[b * k + j for j in range(1, k)] for b in range(B)]
    elif len(rows) == B:
        streams = list(rows)
        copies = [[(sid, j) for j in range(1, k)] for sid in rows]
    else:
        return kwargs  # the forward will name the mismatch
    mask = kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(ids)
        kwargs = dict(kwargs, attention_mask=mask)
    extra = {"logits_to_keep": 1} if getattr(model, "_supports_logits_to_keep", lambda: False)() else {}
    # Before the prefill: a prefill cannot always be taken back (more tokens than a slot can roll back).
    cache._check_fork_room(list(zip(streams, copies)), opening=streams)
    cache.select(streams)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], cache=cache, **extra)
    cache._select_forks(list(zip(streams, copies)))
    cache.selected.set_columns(P - 1)
    return kwargs
