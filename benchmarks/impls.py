"""One model step at steady state, done five ways, for the benchmarks.

`Steady(workload)` puts every batch lane of a workload at a stream far past
its window (rings wrapped), fills the flexkv cache with random keys and
values, and reads back, per row, the entries the cache keeps, in stream
order. Every implementation starts from that same content, so their outputs
on the first step must agree (`check` compares them), and each then runs
the same per-layer `q, k, v` through write + attention for all layers:

- `FlexKV`: plan on the host + the compiled `BoundedKVManager.attend`;
- `Gather`: per row, concatenate the retained ranges and the step's tokens
  from a per-row ring, then `scaled_dot_product_attention`;
- `CatSlice`: a per-request contiguous cache; append the step, batched SDPA,
  slice back to sink + window (the shape of StreamingLLM's own cache);
- `Unbounded`: keep everything, a stream of 8x the window, dense SDPA with
  the retention mask;
- `LaidOut`: SDPA over each row's retained entries and the step's tokens
  already side by side in one contiguous tensor (no write, no copy): the
  limit of any cache layout with this kernel;
- `Floor`: one read of exactly the bytes the step must read (retained keys
  and values of every row and layer, plus the step's own q, k, v).

All of it is attention only: the projections around it are the same for
every implementation and are left out, so the ratios compare the caches.
"""

from __future__ import annotations

import time
from typing import List

import torch
import torch.nn.functional as F

from flexkv import BoundedKVManager, BoundedKVStep, Segment, StreamPosition
from flexkv.cache.host.layout import entry_cell
from flexkv.cache.paths.attention_options import AttentionOptions
from flexkv.cli.stream_model import StreamModel
from flexkv.cli.workload import Workload
from flexkv.compiling import fresh_function
from flexkv.model.reference import attended_indices

__all__ = ["Steady", "FlexKV", "Gather", "CatSlice", "LaidOut", "Unbounded", "Floor", "IMPLS", "check"]


class Steady:
    """A workload at steady state: every lane busy, every stream past its window, shared content."""

    ROUND_SETS = 2  # distinct q/k/v sets, cycled over rounds

    def __init__(self, w: Workload, seed: int = 0, path: str = "auto", fast: bool = True):
        self.w = w
        self.cfg = cfg = w.config()
        g = torch.Generator().manual_seed(seed)
        self.model = StreamModel(w, seed=seed)
        self.manager = m = BoundedKVManager(cfg, "cpu", block_size=w.block_size,
                                            options=AttentionOptions.for_cache(cfg, "cpu", path=path,
                                                                               cpu_fast_paths=fast))
        dt = w.torch_dtype
        B, R, H, D, Hq = w.requests, w.rows, w.kv_heads, w.head_dim, w.num_q_heads
        self.B, self.R, self.N, self.H, self.D, self.Hq = B, R, B * R, H, D, Hq
        self.T, self.span = w.step_tokens, w.span
        if w.final_tokens is not None and w.final_span:
            raise ValueError("benchmarks time the regular step; a writing last chunk is not modelled")
        with torch.no_grad():
            for l in range(w.layers):
                for buf in m.store.layer_kv(l):
                    buf.copy_(torch.randn(buf.shape, generator=g))
        self.sources = []
        for s in range(w.sources if w.source_len else 0):
            shape = (w.layers, R, H, w.source_len, D)
            k, v = torch.randn(shape, generator=g).to(dt), torch.randn(shape, generator=g).to(dt)
            self.sources.append((m.add_source(k, v), k, v))
        ring = m.layout.ring_len
        base = -(-(w.sink + 2 * ring) // self.span) * self.span
        # Staggered positions (whole steps), so rows sit at different ring offsets.
        self.written = [base + self.span * ((7 * i) % 11) for i in range(B)]
        self.rids = list(range(B))
        self.src_of = [i % max(w.sources, 1) if w.source_len else 0 for i in range(B)]
        first = BoundedKVStep(tuple(Segment(r, self.span) for r in self.rids),
                              {r: StreamPosition(w.source_len, 0, self.src_of[r]) for r in self.rids},
                              tokens=self.T)
        m.admit(first)
        jump = BoundedKVStep(tuple(Segment(r, self.span) for r in self.rids),
                             {r: StreamPosition(w.source_len, self.written[r] - self.span, self.src_of[r])
                              for r in self.rids}, tokens=self.T)
        m.commit(jump)  # written = position.written + span: the streams now stand far past the window

        # What every row keeps, in stream order, read out of the cache through the plan's row table.
        plan = m.plan(self.step())
        pol = cfg.retention_for(w.source_len)
        self.kept = pol.sink + pol.window
        self.keys: List[torch.Tensor] = []
        self.values: List[torch.Tensor] = []
        cells = []
        for i in range(self.N):
            row = plan.row(i)
            n = row["n"]
            kept = list(range(pol.sink)) + list(range(n - pol.window, n))
            cells.append([entry_cell(row, ring, j)[1] for j in kept])
        idx = torch.tensor(cells)  # [N, kept]
        for l in range(w.layers):
            kc, vc = (t[0] for t in m.store.layer_kv(l))  # [H, S, D]
            self.keys.append(kc[:, idx].permute(1, 0, 2, 3).contiguous())  # [N, H, kept, D]
            self.values.append(vc[:, idx].permute(1, 0, 2, 3).contiguous())
        self.inputs = []
        for _ in range(self.ROUND_SETS):
            self.inputs.append([
                (torch.randn(self.N, Hq, self.T, D, generator=g).to(dt),
                 torch.randn(self.N, H, self.T, D, generator=g).to(dt),
                 torch.randn(self.N, H, self.T, D, generator=g).to(dt))
                for _ in range(w.layers)
            ])
        # Key order of a row for the batched baselines: kept entries, then own tokens, in stream order.
        # Relative stream indices (n = kept entries' end) decide masks and in-cache positions.
        self.written0 = list(self.written)  # the positions the kept content belongs to (flexkv moves on)
        self.n0 = w.source_len + self.written0[0]
        self.attend_sets = attended_indices(cfg, w.source_len, self.written0[0], self.span, self.T)

    def step(self) -> BoundedKVStep:
        w = self.w
        return BoundedKVStep(tuple(Segment(r, self.span) for r in self.rids),
                             {r: StreamPosition(w.source_len, self.written[r], self.src_of[r]) for r in self.rids},
                             tokens=self.T)

    # -------------------------------------------------------------- bytes

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.w.torch_dtype).element_size()

    def read_entries(self) -> int:
        """Retained entries a row's step must read (the union over its queries)."""
        return len(set(j for s in self.attend_sets for j in s if j < self.n0))

    def bytes_per_step(self) -> int:
        """Retained K and V of every row and layer, plus the step's own q, k, v."""
        w = self.w
        per_layer = self.N * self.read_entries() * self.H * self.D * 2
        per_layer += self.N * self.T * (self.Hq + 2 * self.H) * self.D
        return per_layer * w.layers * self.itemsize

    # ------------------------------------------------------- masks, biases

    def order_and_queries(self, n: int, kept: List[int]):
        """Key stream indices (kept, then own) and query stream indices for a row at length n."""
        own = list(range(n, n + self.T))  # the baselines hold own tokens in stream order
        return kept + own, own

    def mask_and_bias(self, layer: int, key_pos: List[int], q_pos: List[int], attended: List[List[int]]):
        """SDPA attn_mask for keys at `key_pos` (stream indices): None, bool [T, S] or float [1, Hq, T, S]."""
        w = self.w
        S = len(key_pos)
        allowed = torch.zeros(self.T, S, dtype=torch.bool)
        col = {j: c for c, j in enumerate(key_pos)}
        for t in range(self.T):
            allowed[t, [col[j] for j in attended[t]]] = True
        if w.score_bias != "relative":
            return None if bool(allowed.all()) else allowed
        if w.reverse_step_order or w.query_window is not None:
            raise NotImplementedError("relative bias is modelled for stream-order, per-step windows only")
        # In-cache positions: the rank of an entry among what the query attends (sinks keep theirs).
        table = getattr(self.model, f"bias_{layer}")
        shift, top = w.max_tokens - 1, self.model.bias_len - 1
        bias = torch.full((1, self.Hq, self.T, S), float("-inf"), dtype=w.torch_dtype)
        for t in range(self.T):
            rank = {j: r for r, j in enumerate(attended[t])}
            qr = rank[q_pos[t]]
            cols = [col[j] for j in attended[t]]
            rel = torch.tensor([qr - rank[j] + shift for j in attended[t]]).clamp(0, top)
            bias[0, :, t, cols] = table[:, rel]
        return bias


# ---------------------------------------------------------------- flexkv


class FlexKV:
    """The compiled cache: host plan, then one compiled attention function per layer (or one graph)."""

    name = "flexkv"

    def __init__(self, st: Steady, mode: str = "layer"):
        self.st = st
        m, model, L = st.manager, st.model, st.w.layers

        def make(l):
            def attend_layer(plan, q, k, v):
                return m.attend(l, q, k, v, plan, score_mod=model.score_mod(l), positions=model.positions)

            return attend_layer

        if mode == "layer":
            fns = [torch.compile(fresh_function(make(l), f"bench{l}"), fullgraph=True, dynamic=False)
                   for l in range(L)]
            self.run = lambda plan, inputs: [fns[l](plan, *inputs[l]) for l in range(L)]
        else:
            attends = [make(l) for l in range(L)]

            def whole(plan, inputs):
                return [attends[l](plan, *inputs[l]) for l in range(L)]

            self.run = torch.compile(whole, fullgraph=True, dynamic=False)
        self.plan_s: List[float] = []
        # Compile on an all-padding step: nothing is written where a request reads.
        pad = BoundedKVStep(tuple(Segment(None, 0) for _ in st.rids), {}, tokens=st.T)
        t0 = time.perf_counter()
        with torch.no_grad():
            self.run(m.plan(pad), st.inputs[0])
        self.compile_s = time.perf_counter() - t0

    def step(self, inputs):
        st, m = self.st, self.st.manager
        t0 = time.perf_counter()
        s = st.step()
        m.admit(s)
        plan = m.plan(s)
        self.plan_s.append(time.perf_counter() - t0)
        with torch.no_grad():
            out = self.run(plan, inputs)
        m.commit(s)
        st.written = [x + st.span for x in st.written]
        return out


# ------------------------------------------------------------- baselines


def _own_stream_order(st: Steady, k: torch.Tensor) -> torch.Tensor:
    """The step's own tokens `[.., T, D]` in stream order (written ones reversed under reverse_step_order)."""
    if not st.w.reverse_step_order or st.span <= 1:
        return k
    return torch.cat([k[:, :, :st.span].flip(2), k[:, :, st.span:]], dim=2)


def _sdpa(q, k, v, mask, gqa):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class Gather:
    """Per row: concatenate the retained ranges of a ring and the step's tokens, then SDPA."""

    name = "gather"

    def __init__(self, st: Steady):
        self.st = st
        w = st.w
        pol = st.cfg.retention_for(w.source_len)
        self.sink, self.window = pol.sink, pol.window
        self.L = w.source_len
        self.sink_cells = max(self.sink - self.L, 0)
        self.ring = self.window + st.T
        C = self.sink_cells + self.ring
        self.n = [w.source_len + x for x in st.written0]
        self.K, self.V = [], []  # per layer [N, H, C, D]
        for l in range(w.layers):
            K = torch.zeros(st.N, st.H, C, st.D, dtype=w.torch_dtype)
            V = torch.zeros_like(K)
            for i in range(st.N):
                n = self.n[i // st.R]
                kept = list(range(self.sink)) + list(range(n - self.window, n))
                for c, j in enumerate(kept):
                    if j < self.L:
                        continue  # source entries stay in the source
                    cell = j - self.L if j < max(self.sink, self.L) else self.sink_cells + j % self.ring
                    K[i, :, cell] = st.keys[l][i, :, c]
                    V[i, :, cell] = st.values[l][i, :, c]
            self.K.append(K)
            self.V.append(V)
        self.src = {}
        for idx, k, v in st.sources:
            self.src[idx] = (k, v)
        n0 = st.n0
        key_pos, q_pos = st.order_and_queries(n0, list(range(self.sink)) + list(range(n0 - self.window, n0)))
        self.masks = [st.mask_and_bias(l, key_pos, q_pos, st.attend_sets) for l in range(w.layers)]

    def _ranges(self, n):
        """(source part, [(a, b) cell ranges in stream order]) of a row at stream length n."""
        lo, hi = n - self.window, n
        parts = []
        if self.sink_cells:
            parts.append((0, self.sink_cells))
        a, b = lo % self.ring, (hi - 1) % self.ring + 1
        base = self.sink_cells
        if a < b:
            parts.append((base + a, base + b))
        else:
            parts += [(base + a, base + self.ring), (base, base + b)]
        return parts

    def step(self, inputs):
        st = self.st
        outs = []
        src_sink = min(self.sink, self.L)
        for l, (q, k, v) in enumerate(inputs):
            K, V = self.K[l], self.V[l]
            ko, vo = _own_stream_order(st, k), _own_stream_order(st, v)
            out = torch.empty_like(q)
            for i in range(st.N):
                req, r = divmod(i, st.R)
                n = self.n[req]
                pk, pv = [], []
                if src_sink:
                    sk, sv = self.src[st.src_of[req]]
                    pk.append(sk[l, r, :, :src_sink])
                    pv.append(sv[l, r, :, :src_sink])
                for a, b in self._ranges(n):
                    pk.append(K[i, :, a:b])
                    pv.append(V[i, :, a:b])
                pk.append(ko[i])
                pv.append(vo[i])
                kk = torch.cat(pk, dim=1)[None]
                vv = torch.cat(pv, dim=1)[None]
                out[i] = _sdpa(q[i:i + 1], kk, vv, self.masks[l], st.Hq != st.H)[0]
                # Keep the written tokens: stream index n + t goes to ring cell (n + t) % ring.
                cells = [self.sink_cells + (n + t) % self.ring for t in range(st.span)]
                K[i, :, cells] = ko[i, :, :st.span]
                V[i, :, cells] = vo[i, :, :st.span]
            outs.append(out)
        self.n = [x + st.span for x in self.n]
        return outs


class CatSlice:
    """A per-request contiguous cache: append the step, batched SDPA, slice back to sink + window."""

    name = "cat-slice"

    def __init__(self, st: Steady):
        self.st = st
        w = st.w
        pol = st.cfg.retention_for(w.source_len)
        self.sink, self.window = pol.sink, pol.window
        self.K = [k.clone() for k in st.keys]  # [N, H, sink + window, D], stream order
        self.V = [v.clone() for v in st.values]
        n = st.n0
        key_pos, q_pos = st.order_and_queries(n, list(range(self.sink)) + list(range(n - self.window, n)))
        self.masks = [st.mask_and_bias(l, key_pos, q_pos, st.attend_sets) for l in range(w.layers)]

    def step(self, inputs):
        st, s, span = self.st, self.sink, self.st.span
        outs = []
        for l, (q, k, v) in enumerate(inputs):
            ko, vo = _own_stream_order(st, k), _own_stream_order(st, v)
            Kc = torch.cat([self.K[l], ko], dim=2)
            Vc = torch.cat([self.V[l], vo], dim=2)
            outs.append(_sdpa(q, Kc, Vc, self.masks[l], st.Hq != st.H))
            # Slice back: the sinks, then the last `window` of the window entries and the written tokens.
            self.K[l] = torch.cat([Kc[:, :, :s], Kc[:, :, s + span:s + span + self.window]], dim=2)
            self.V[l] = torch.cat([Vc[:, :, :s], Vc[:, :, s + span:s + span + self.window]], dim=2)
        return outs


class LaidOut:
    """SDPA over K/V already laid out contiguously per row: retained entries, then the step's tokens.

    The step's keys and values are placed once, at construction (from the first round's inputs),
    so a timed step is the attention kernel alone: what no cache layout can beat with this kernel.
    """

    name = "laid-out"

    def __init__(self, st: Steady, inputs=None):
        self.st = st
        w = st.w
        inputs = st.inputs[0] if inputs is None else inputs
        n = st.n0
        pol = st.cfg.retention_for(w.source_len)
        key_pos, q_pos = st.order_and_queries(n, list(range(pol.sink)) + list(range(n - pol.window, n)))
        self.masks = [st.mask_and_bias(l, key_pos, q_pos, st.attend_sets) for l in range(w.layers)]
        self.K = [torch.cat([st.keys[l], _own_stream_order(st, k)], dim=2) for l, (_, k, _) in enumerate(inputs)]
        self.V = [torch.cat([st.values[l], _own_stream_order(st, v)], dim=2) for l, (_, _, v) in enumerate(inputs)]

    def step(self, inputs):
        st = self.st
        return [_sdpa(q, self.K[l], self.V[l], self.masks[l], st.Hq != st.H) for l, (q, _, _) in enumerate(inputs)]


class Unbounded:
    """Keep every entry (a stream of 8x the window), dense SDPA with the retention mask."""

    name = "unbounded"
    FACTOR = 8

    def __init__(self, st: Steady, seed: int = 1):
        self.st = st
        w = st.w
        pol = st.cfg.retention_for(w.source_len)
        g = torch.Generator().manual_seed(seed)
        self.n = n = self.FACTOR * pol.window
        S = n + st.T
        self.K, self.V = [], []
        kept = list(range(pol.sink)) + list(range(n - pol.window, n))
        for l in range(w.layers):
            K = torch.randn(st.N, st.H, S, st.D, generator=g).to(w.torch_dtype)
            V = torch.randn(st.N, st.H, S, st.D, generator=g).to(w.torch_dtype)
            K[:, :, kept] = st.keys[l]
            V[:, :, kept] = st.values[l]
            self.K.append(K)
            self.V.append(V)
        sets = attended_indices(st.cfg, w.source_len, n - w.source_len, st.span, st.T)
        key_pos = list(range(S))
        self.masks = [st.mask_and_bias(l, key_pos, list(range(n, n + st.T)), sets) for l in range(w.layers)]

    def step(self, inputs):
        st = self.st
        outs = []
        for l, (q, k, v) in enumerate(inputs):
            # Write the step at the end of the stream (the stream stays at 8x the window).
            self.K[l][:, :, self.n:] = _own_stream_order(st, k)
            self.V[l][:, :, self.n:] = _own_stream_order(st, v)
            outs.append(_sdpa(q, self.K[l], self.V[l], self.masks[l], st.Hq != st.H))
        return outs


class Floor:
    """One read of exactly the bytes the step must read: a sum over a buffer of that size per layer."""

    name = "floor"

    def __init__(self, st: Steady):
        per_layer = st.bytes_per_step() // st.w.layers // st.itemsize
        self.bufs = [torch.randn(per_layer).to(st.w.torch_dtype) for _ in range(st.w.layers)]

    def step(self, inputs=None):
        return [b.sum() for b in self.bufs]


IMPLS = {"flexkv": FlexKV, "gather": Gather, "cat-slice": CatSlice, "laid-out": LaidOut, "unbounded": Unbounded,
         "floor": Floor}


def check(reference: List[torch.Tensor], got: List[torch.Tensor], name: str, tol: float = 1e-4) -> float:
    """Largest |difference| between two implementations' outputs of one step; raises above `tol`."""
    err = max(float((a.double() - b.double()).abs().max()) for a, b in zip(reference, got))
    if not err < tol:
        raise AssertionError(f"{name} disagrees with flexkv by {err:.3g} (> {tol}) on the first step")
    return err
