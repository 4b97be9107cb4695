"""Relative-position attention: Transformer-XL's and the conformers' ("rel_pos") query-dependent term.

Transformer-XL, ESPnet's and WeNet's `RelPositionMultiHeadedAttention` score
query `i` against key `j` as

    ((q_i + u) . k_j + (q_i + v) . p(i - j)) * scale,    p(d) = W_pos pe(d)

with learned biases `u`, `v` per head and `pe` a sinusoidal encoding of the
relative distance. The first term is ordinary attention over `q + u`. The
second depends on the query *vector* and the distance, so it cannot be a
table fixed from the weights; but a step's queries only ever meet a bounded
range of distances: a query reads at most the retained window and the
step's own tokens, so with no sinks `i - j` lies in `[lo, hi]` with

    lo = -(T - 1)  (a per-step window: a query reads the later tokens of its step;
                    0 for a per-query window or `causal_step=True`)
    hi = max_retained + T - 1

(`T` the step's tokens). `RelativePosition(config)` holds that range
(`distances`, the `d` to encode); per step and layer, `scores(q + v, p,
stream_positions)` forms the table `bd[n, h, t, d - lo] = scale * (q + v) .
p(d)` with one matmul (`N x H x T x R` values, `R = hi - lo + 1`) and
returns it as a score_mod (`RelativePositionScores`) that adds `bd` at each
score's query token and distance. Pass it to `attend(..., score_mod=...)` with
`positions="stream"` (the default) and `q + u` as the query.

It is an ordinary score_mod, so every cache runs it (the bounded cache on
either attention path, eager or compiled, with one layer group or
several, the uncached twin). `BoundedKVManager` recognises it as additive: on the rows
path it is gathered once per call into the dense attention's additive mask,
so the fused SDPA kernel still runs; on the FlexAttention path it is the
kernel's score_mod, reading `bd` at the query's token (`at`): a tensor
computed inside the compiled step, which torch 2.13's compiled CPU kernel
takes when it is a buffer of its own (a matmul's output).

Sinks sit at the start of the stream, so a stream distance to them grows
without bound: a cache whose retention keeps sinks (or a source as sinks)
needs `max_distance`, which clips `i - j` to it, as Shaw et al.'s
relative attention does; without it `RelativePosition` refuses the config.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...config import BoundedKVConfig, is_int

__all__ = ["RelativePosition", "RelativePositionScores", "distance_range"]


def _has_sinks(config: BoundedKVConfig) -> bool:
    return any(config.retention_for(L).sink > 0 for L in range(config.min_source_len, config.max_source_len + 1))


def distance_range(config: BoundedKVConfig, tokens: Optional[int] = None, max_distance: Optional[int] = None):
    """`(lo, hi)`: the smallest and largest `q_pos - kv_pos` a step of `tokens` tokens can score.

    `tokens`: the step's `T` (default `config.max_step_tokens`). `max_distance`: clip larger
    distances to it (needed when the retention keeps sinks; see the module notes).
    """
    if not isinstance(config, BoundedKVConfig):
        raise ValueError(f"distance_range: config must be a BoundedKVConfig, got {type(config).__name__}")
    T = config.max_step_tokens if tokens is None else tokens
    if not is_int(T) or not 1 <= T <= config.max_step_tokens:
        raise ValueError(f"distance_range: tokens must be an int in [1, max_step_tokens={config.max_step_tokens}], "
                         f"got {tokens!r}")
    causal = config.query_window is not None or config.causal_step
    lo = 0 if causal else -(T - 1)
    if config.query_window is not None:
        reach = config.query_window
    else:
        reach = config.max_retained + T - 1
    if max_distance is not None:
        if not is_int(max_distance) or max_distance < max(lo, 0):
            raise ValueError(f"max_distance must be an int >= {max(lo, 0)}, got {max_distance!r}")
        return lo, max_distance if _has_sinks(config) else min(max_distance, reach)
    if _has_sinks(config):
        raise ValueError(
            "relative positions over a retention that keeps sinks: a query's stream distance to a sink grows "
            "without bound as the stream goes on, so no table covers it; give max_distance=... to clip distances "
            "(every distance past it scores as max_distance), or keep no sinks (SinkWindow(0, window))"
        )
    return lo, reach


class RelativePosition:
    """The distances one cache layer's queries meet, and the per-step score tables over them.

    Args:
        config: the layer's config (`cache.layer_config(layer)`).
        tokens: the step's `T` (default `config.max_step_tokens`); a step of fewer tokens
            may use a table built for more.
        max_distance: clip distances beyond it (required with sinks).
    """

    def __init__(self, config: BoundedKVConfig, tokens: Optional[int] = None, max_distance: Optional[int] = None):
        self.config = config
        self.lo, self.hi = distance_range(config, tokens, max_distance)
        self.tokens = config.max_step_tokens if tokens is None else tokens

    @property
    def size(self) -> int:
        """`R`: how many distances the table holds."""
        return self.hi - self.lo + 1

    def distances(self, device=None, dtype=torch.long) -> torch.Tensor:
        """`[R]`: the distances `i - j` from `lo` to `hi`, ascending: encode these as `pe(d)`."""
        return torch.arange(self.lo, self.hi + 1, device=device, dtype=dtype)

    def scores(self, query: torch.Tensor, pos: torch.Tensor, stream_positions: torch.Tensor,
               scale: Optional[float] = None) -> "RelativePositionScores":
        """The step's position term as a score_mod.

        `query`: `[N, Hq, T, D]`, the queries plus the position bias (`q + v`);
        `pos`: `[R, Hq, D]` (or `[R, Hq * D]`), `p(d) = W_pos pe(d)` at `distances()`;
        `stream_positions`: the step's `[N, T]` stream indices (`cache.stream_positions(plan)`,
        `context.stream_positions()`); `scale`: the one given to `attend` (default `D ** -0.5`).
        """
        if not isinstance(query, torch.Tensor) or query.dim() != 4:
            got = tuple(query.shape) if isinstance(query, torch.Tensor) else type(query).__name__
            raise ValueError(f"RelativePosition.scores: query must be [N, Hq, T, D], got {got}")
        N, Hq, T, D = query.shape
        if T > self.tokens:
            raise ValueError(f"RelativePosition.scores: the table covers steps of up to {self.tokens} tokens, "
                             f"got T={T}; build RelativePosition(config, tokens={T})")
        if not isinstance(pos, torch.Tensor) or pos.dim() not in (2, 3) or pos.shape[0] != self.size \
                or pos.numel() != self.size * Hq * D:
            got = tuple(pos.shape) if isinstance(pos, torch.Tensor) else type(pos).__name__
            raise ValueError(
                f"RelativePosition.scores: pos must be [R={self.size}, Hq={Hq}, D={D}] (one projected encoding per "
                f"distance in distances(), {self.lo}..{self.hi}), got {got}"
            )
        if tuple(stream_positions.shape) != (N, T):
            raise ValueError(f"RelativePosition.scores: stream_positions must be [N, T] = [{N}, {T}], "
                             f"got {tuple(stream_positions.shape)}")
        scale = D ** -0.5 if scale is None else scale
        p = pos.reshape(self.size, Hq, D).to(query.dtype).permute(1, 2, 0)  # [Hq, D, R]
        # The table is a matmul's output, a buffer of its own: torch 2.13's compiled CPU
        # FlexAttention cannot lower a score_mod that captures an unmaterialised expression.
        bd = torch.matmul(query * scale, p)  # [N, Hq, T, R]
        # A row's own tokens hold T consecutive stream indices (in either step order): the token
        # at stream index q_pos is row[b, q_pos % T] of the step.
        rows = torch.argsort(stream_positions % T, dim=1)
        return RelativePositionScores(bd, rows, self.lo)


class RelativePositionScores:
    """A score_mod adding `bd[b, h, t, q_pos - kv_pos - lo]` to each score (`t`: the query's token in the step).

    Built by `RelativePosition.scores`; positions are stream indices. As a plain score_mod (any
    cache) it finds `t` from `q_pos`; `BoundedKVManager` calls `at` with the query's token itself,
    and on its rows path folds the term into the attention mask.
    """

    def __init__(self, bd: torch.Tensor, rows: torch.Tensor, lo: int):
        self.bd, self.rows, self.lo = bd, rows, lo
        self.heads, self.tokens, self.size = bd.shape[1], bd.shape[2], bd.shape[3]
        # Read through one index into the flat table where its positions fit in int32 (FlexAttention's
        # index dtype): one gather instead of four broadcast indices, about twice as fast on the
        # rows path, which forms the whole [B, H, T, W] term at once.
        self.flat = bd.reshape(-1) if bd.is_contiguous() and bd.numel() < 2 ** 31 else None

    def at(self, score, b, h, t, q_pos, kv_pos):
        """The score of query token `t` (at stream index `q_pos`) against the key at `kv_pos`."""
        d = (q_pos - kv_pos - self.lo).clamp(0, self.size - 1)
        if self.flat is None:
            return score + self.bd[b, h, t, d]
        row = (b * self.heads + h) * self.tokens + t
        if row.dim() == 4 and d.dim() == 4 and row.shape[-1] == 1:
            # The rows path's whole [B, H, T, W] block (FlexAttention calls this per score, on
            # scalars): the table's rows for each (b, h, t), then each key's distance along them.
            shape = torch.broadcast_shapes(row.shape, d.shape)
            rows = self.bd.view(-1, self.size).index_select(0, row.expand(shape[:-1] + (1,)).reshape(-1))
            return score + rows.view(shape[:-1] + (self.size,)).gather(-1, d.expand(shape))
        return score + self.flat[row * self.size + d]

    def __call__(self, score, b, h, q_pos, kv_pos):
        return self.at(score, b, h, self.rows[b, q_pos % self.tokens], q_pos, kv_pos)
