"""The small bounded-cache configuration the tests start from.

A test names only the fields it is about: `small_config(retention=SinkWindow(1, 3))`, or, for a
module whose tests share some changes, `config = partial(small_config, num_layers=3, query_window=3)`
(a later keyword wins, so `config(num_layers=1)` still works). Everything else is `BASE`: two
layers, two heads of 8, one row per request, no sources, 2 sinks + a window of 6, three slots and
steps of up to three tokens.
"""

from __future__ import annotations

from flexkv import BoundedKVConfig, SinkWindow

BASE = dict(num_layers=2, num_heads=2, head_dim=8, rows_per_request=1, max_source_len=0, max_sources=0,
            retention=SinkWindow(2, 6), max_slots=3, max_step_tokens=3)


def small_config(**changes) -> BoundedKVConfig:
    """`BASE` with `changes` applied."""
    return BoundedKVConfig(**{**BASE, **changes})
