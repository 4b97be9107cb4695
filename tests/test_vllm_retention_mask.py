"""flexkv's retention as vLLM's FlexAttention reads it (flexkv.integrations.vllm.retention_mask): no vLLM needed."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_mask

from flexkv.integrations.vllm.retention_mask import retention_block_hint, retention_mask_mod

SINK, WINDOW, BS = 2, 3, 4


def test_a_query_attends_its_sinks_and_its_window():
    dense = create_mask(retention_mask_mod(SINK, WINDOW), 1, 1, 10, 10, device="cpu")[0, 0]
    assert dense[7].nonzero().flatten().tolist() == [0, 1, 4, 5, 6, 7]
    assert dense[1].nonzero().flatten().tolist() == [0, 1]  # before the window is full: every earlier entry


def test_the_block_hint_keeps_every_block_a_query_reads():
    """For every query of a query block of `BS` tokens, each KV block holding an entry it attends is kept."""
    dense = create_mask(retention_mask_mod(SINK, WINDOW), 1, 1, 40, 40, device="cpu")[0, 0]
    hint = retention_block_hint(SINK, WINDOW)
    for q in range(40):
        read = {int(j) // BS for j in dense[q].nonzero().flatten()}
        kept = hint(torch.tensor([[q // BS]]), torch.arange(10)[None], BS)[0]
        assert all(kept[b] for b in read), q


def test_the_block_hint_drops_blocks_between_the_sinks_and_the_window():
    hint = retention_block_hint(SINK, WINDOW)
    kept = hint(torch.tensor([[9]]), torch.arange(10)[None], BS)[0].tolist()  # queries 36-39: window from 33
    assert kept == [True, False, False, False, False, False, False, False, True, True]
