"""A stream's last token across `generate()` calls: the one `generate()` returned and never fed.

`generate()` appends the token it picks at each step and feeds it in the next
step's forward; the last token it picks is returned but never fed. A stream
continued by a later `generate()` call must attend it before the new input,
or the conversation it holds is one token short of what the user saw. The
cache records that token per stream (`FlexKVCache.selected`, `Selection.owe`) when `generate()`
returns, forgets it once a forward feeds the stream (it is then either in
that forward's input or the user chose to feed something else), and
`with_owed_tokens` feeds it at the start of the next `generate()` call that
starts from a fresh selection (`get_seq_length() == 0`) with only the new
tokens: it is placed right before each row's first real token and the extra
column is removed from what `generate()` returns, so the caller sees the
shapes it passed. A call that hands `generate()` its previous output plus
new tokens (`get_seq_length() > 0`) already feeds the token itself.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["check_continuation", "with_owed_tokens", "strip_first_column", "record_owed_tokens"]


def _inputs(args, kwargs):
    if args:
        return args[0], "args"
    for name in ("inputs", "input_ids"):
        if kwargs.get(name) is not None:
            return kwargs[name], name
    return None, None


def check_continuation(cache, args, kwargs) -> None:
    """Refuse, before anything runs, a `generate()` call whose ids are no longer than what the selected
    streams were fed since `select()`: transformers feeds only the columns past `get_seq_length()`, so such
    a call (a chat continued with only the new message's ids, without `select()`) would feed nothing."""
    columns = cache.selected.columns
    ids, _ = _inputs(args, kwargs)
    if not columns or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] > columns:
        return
    rows = list(cache.selected.streams or ())
    raise ValueError(
        f"generate() was given {ids.shape[1]} columns of input_ids, but streams {rows} were fed {columns} "
        f"columns since the last select() (get_seq_length() == {columns}), and generate() feeds only the "
        f"columns past get_seq_length(): this call has nothing to feed. To continue with only the new "
        f"message's ids, call cache.select({rows}) first (the cache then feeds the token the last generate() "
        f"returned before them); or hand generate() its previous output followed by the new ids"
    )


def with_owed_tokens(cache, model, args, kwargs) -> Optional[tuple]:
    """`(args, kwargs)` for a `generate()` call with each row's owed token fed first, or None (nothing owed).

    Refuses (before anything changes) a call whose rows cannot take the token: `inputs_embeds` without ids,
    or `num_return_sequences` continuing streams (one prompt row for several streams with different tokens).
    """
    if cache.selected.columns or not cache.selected.owed:
        return None
    ids, where = _inputs(args, kwargs)
    held = set(cache.manager.requests)
    if ids is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        if kwargs.get("inputs_embeds") is not None:
            rows = cache.selected.streams or ()
            owed = [sid for sid in rows if sid in cache.selected.owed and sid in held]
            if owed:
                raise ValueError(
                    f"streams {owed} continue after a token generate() returned and never fed; with inputs_embeds "
                    f"flexkv cannot feed it first: continue them with input_ids, or hand generate() the previous "
                    f"output plus the new tokens without select()"
                )
        return None
    B, T = ids.shape
    rows = cache.selected.rows(B)
    owed = [cache.selected.owed.get(sid) if sid in held else None for sid in rows]
    if all(t is None for t in owed):
        return None
    if len(rows) != B:
        raise ValueError(
            f"streams {[s for s, t in zip(rows, owed) if t is not None]} continue after a token generate() returned "
            f"and never fed, but this call has {B} prompt rows for {len(rows)} streams (num_return_sequences); "
            f"continue each stream with a row of its own"
        )
    mask = kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(ids)
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else int(pad if not isinstance(pad, (list, tuple)) else pad[0])
    flags = mask.bool().to("cpu").tolist()
    new_ids = ids.new_full((B, T + 1), pad)
    new_mask = mask.new_zeros((B, T + 1))
    for b, token in enumerate(owed):
        at = next((c for c, f in enumerate(flags[b]) if f), T)  # before the row's first real token
        if token is None:
            new_ids[b, 1:], new_mask[b, 1:] = ids[b], mask[b]
            continue
        new_ids[b, :at], new_mask[b, :at] = ids[b, :at], mask[b, :at]
        new_ids[b, at], new_mask[b, at] = token, 1
        new_ids[b, at + 1:], new_mask[b, at + 1:] = ids[b, at:], mask[b, at:]
    kwargs = dict(kwargs, attention_mask=new_mask)
    if where == "args":
        args = (new_ids,) + tuple(args[1:])
    else:
        kwargs[where] = new_ids
    return args, kwargs


def strip_first_column(result):
    """`generate()`'s output without the column `with_owed_tokens` added."""
    if isinstance(result, torch.Tensor):
        return result[:, 1:]
    seqs = getattr(result, "sequences", None)
    if isinstance(seqs, torch.Tensor):
        result.sequences = seqs[:, 1:]
    return result


def record_owed_tokens(cache, result, fed_columns: int) -> None:
    """After `generate()` returned: each row's last token is owed to its stream (returned, never fed)."""
    seqs = result if isinstance(result, torch.Tensor) else getattr(result, "sequences", None)
    rows = cache.selected.streams
    if not isinstance(seqs, torch.Tensor) or rows is None or seqs.shape[0] != len(rows) or seqs.shape[1] == 0:
        return
    if cache.selected.columns <= fed_columns:
        return  # no forward ran
    last = seqs[:, -1].to("cpu").tolist()
    held = set(cache.manager.requests)
    for sid, token in zip(rows, last):
        if sid in held:
            cache.selected.owe(sid, token)
