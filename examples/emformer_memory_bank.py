"""torchaudio's Emformer streamed on flexkv: a segment's frames, its look-ahead and a memory bank in one softmax.

Emformer (a streaming ASR encoder) runs each segment of `U` frames with `R`
frames of look-ahead (right context). In every layer the queries are the
look-ahead, the segment and one summary of the segment (its mean); the keys
are a bank of the last `M` memory entries, the look-ahead, the last `L`
frames of left context and the segment, in one softmax; the summary query
does not read the bank. The summary's output is the next layer's memory
entry, and what entered a layer's bank at one segment is read from the next
segment on.

On flexkv each layer keeps two caches, each with its own retention and at
the model's own memory, and attends once (the joint path,
`flexkv.cache.paths.joint_path`):

- the frames (`SinkWindow(0, L)`, `U` tokens a step): the segment's frames
  are the step's own queries; the look-ahead and the summary are query-only
  queries (`attend_joined(..., query_only=)`), which read what the segment's frames read and
  write nothing;
- the bank (`SinkWindow(0, M, window_includes_step=True)`, one token a
  step): each segment writes the entry the layer received one segment
  before (`write_part`), and its cells join the call, read by every query
  but the summary (`KeyPart.for_queries`);
- the look-ahead's own keys are recomputed every segment (as the model
  does) and join the call as a plain `KeyPart`.

Both caches step as one (`flexkv.model.multi_context.MultiStepContext`,
eagerly: `eager_only=True`): a segment that raises anywhere, Ctrl-C
included, leaves both as they were, so it can be run again.

Run with torchaudio installed (not a flexkv dependency: the release built for
your torch, `pip install "torchaudio==2.X.*"`, 2.11 at the latest; without it the example says so):

    PYTHONPATH=. python examples/emformer_memory_bank.py --threads 1

checks every segment's output against the model's own `Emformer.infer()`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, Hashable, List, Sequence

import torch

from flexkv import BoundedKVConfig, BoundedKVManager, BoundedKVStep, KeyPart, Segment, SinkWindow, StreamPosition
from flexkv.model.multi_context import MultiStepContext


class FlexkvEmformer:
    """Streaming inference of a `torchaudio.models.Emformer` (eval mode) with flexkv caches.

    `infer(ids, input)` is the model's `infer(input, lengths, states)` for the streams named by `ids`
    (one per batch row; a new id starts a stream): `input [B, U + R, D]`, every frame valid. The
    model's modules, projections and weights are used as they are; only the attention's state moves
    into flexkv.
    """

    def __init__(self, emformer, max_streams: int = 4):
        self.model = emformer
        first = emformer.emformer_layers[0]
        self.U, self.R = emformer.segment_length, emformer.right_context_length
        self.L, self.M = emformer.left_context_length, emformer.max_memory_size
        if self.M < 1 or self.L < 1:
            raise ValueError("FlexkvEmformer: this port needs a memory bank and a left context "
                             f"(max_memory_size={self.M}, left_context_length={self.L})")
        att = first.attention
        self.H = att.num_heads
        self.d = att.input_dim // att.num_heads
        layers = len(emformer.emformer_layers)
        common = dict(num_layers=layers, num_heads=self.H, head_dim=self.d, rows_per_request=1,
                      min_source_len=0, max_source_len=0, max_sources=0, max_slots=max_streams)
        self.frames = BoundedKVManager(BoundedKVConfig(retention=SinkWindow(0, self.L), max_step_tokens=self.U,
                                                       **common), "cpu")
        self.bank = BoundedKVManager(BoundedKVConfig(retention=SinkWindow(0, self.M, window_includes_step=True),
                                                     max_step_tokens=1, **common), "cpu")
        #: The segment's step over both caches, whole or not at all.
        self.context = MultiStepContext({"frames": self.frames, "bank": self.bank})
        #: Per stream: the memory entry each layer received at the last segment (written to its bank next).
        self.pending: Dict[Hashable, torch.Tensor] = {}
        self._no_entry = torch.zeros(layers, att.input_dim)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, B, D]` -> `[B, H, T, d]`."""
        T, B, _ = x.shape
        return x.view(T, B, self.H, self.d).permute(1, 2, 0, 3)

    def _frames(self, out: torch.Tensor) -> torch.Tensor:
        """`[B, H, T, d]` -> `[T, B, D]`."""
        B, H, T, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(T, B, H * d)

    def infer(self, ids: Sequence[Hashable], input: torch.Tensor) -> torch.Tensor:
        """Encode one segment of each stream; `[B, U, D]`."""
        U, R = self.U, self.R
        if input.shape[1] != U + R:
            raise ValueError(f"FlexkvEmformer.infer: input must be [B, {U + R}, D] (segment + right context), "
                             f"got {tuple(input.shape)}")
        x = input.permute(1, 0, 2)
        right, utterance = x[U:], x[:U]
        written = {r: (self.frames.written(r) if r in self.frames.requests else 0) for r in ids}
        fstep = BoundedKVStep(tuple(Segment(r, U) for r in ids), {r: StreamPosition(0, written[r]) for r in ids},
                              tokens=U)
        # A stream's bank takes one entry a segment from its second segment on; until then its row
        # is padding (and at a first segment of every stream, the bank's whole step is padding).
        with_bank = [r for r in ids if r in self.pending]
        bstep = BoundedKVStep(tuple(Segment(r, 1) if r in self.pending else Segment(None, 0) for r in ids),
                              {r: StreamPosition(0, self.bank.written(r) if r in self.bank.requests else 0)
                               for r in with_bank}, tokens=1)
        # Both caches step as one: an exception anywhere in the segment takes back both.
        with self.context.stepping({"frames": fstep, "bank": bstep}, eager_only=True):
            out, entered = self._layers(ids, x, right, utterance)
        entered = torch.stack(entered)  # [layers, B, D]
        for b, r in enumerate(ids):
            self.pending[r] = entered[:, b]
        return out.permute(1, 0, 2)

    def _layers(self, ids, x, right, utterance):
        """Every layer of one segment: one attention call per layer over the step's two caches."""
        U, R = self.U, self.R
        frames, bank = self.context["frames"], self.context["bank"]
        mems = self.model.memory_op(utterance.permute(1, 2, 0)).permute(2, 0, 1)  # [1, B, D]
        entered: List[torch.Tensor] = []
        out = utterance
        # The entry each layer received one segment ago (a zero entry in a padding row, which writes nothing).
        prev = torch.stack([self.pending[r] if r in self.pending else self._no_entry for r in ids], 1)  # [layers, B, D]
        for li, layer in enumerate(self.model.emformer_layers):
            att = layer.attention
            normed = layer.layer_norm_input(torch.cat([right, out]))
            n_utt = normed[R:]
            summary = layer.memory_op(n_utt.permute(1, 2, 0)).permute(2, 0, 1)[:1]
            q = self._heads(att.emb_to_query(torch.cat([normed, summary])))  # [B, H, R + U + 1, d]
            # One projection, as the model makes: the look-ahead, the segment and the bank's new entry.
            k_all, v_all = (self._heads(t) for t in att.emb_to_key_value(torch.cat([normed, prev[li:li + 1]])).chunk(2, 2))
            bk, bv = k_all[:, :, R + U:], v_all[:, :, R + U:]
            # The bank's entry written, its cells read by every query but the summary; the look-ahead's
            # keys (recomputed every segment) read by all; the segment's frames the step's own queries,
            # the look-ahead and the summary query-only (indices U .. U + R): one softmax.
            in_bank = bank.write_part(li, bk, bv)
            att_out = frames.attend_joined(
                li, q[:, :, R:R + U], k_all[:, :, R:R + U], v_all[:, :, R:R + U],
                (in_bank.for_queries(range(U + R)), KeyPart(k_all[:, :, :R], v_all[:, :, :R])),
                query_only=torch.cat([q[:, :, :R], q[:, :, R + U:]], 2), scale=att.scaling).out
            own, extra = att_out[:, :, :U], att_out[:, :, U:]  # the segment's frames, then the query-only ones
            result = att.out_proj(self._frames(torch.cat([extra[:, :, :R], own, extra[:, :, R:]], 2)))
            rc_output, out_mems = result[:R + U], result[R + U:]
            out_mems = torch.tanh(out_mems) if att.tanh_on_mem else torch.clamp(out_mems, min=-10, max=10)
            entered.append(mems[0])
            processed = layer._process_attention_output(rc_output, out, right)
            out, right = processed[R:], processed[:R]
            mems = out_mems
        return out, entered

    def memory_bytes_per_stream(self) -> int:
        """What flexkv holds for one stream: its slot in both caches (the pending memory entries aside)."""
        return self.frames.slot_bytes + self.bank.slot_bytes


def own_state_bytes(states) -> int:
    """What `Emformer.infer` keeps for one stream: its state tensors, per batch row."""
    return sum(t.numel() * t.element_size() // t.shape[1] for layer in states for t in layer[:3])


#: torchaudio's newest release; its releases follow torch's, one for one, up to it.
LAST_TORCHAUDIO = (2, 11)


def torchaudio_hint(torch_version: str) -> str:
    """What to install to run this example beside torch `torch_version`."""
    major, minor = (int(x) for x in torch_version.split("+")[0].split(".")[:2])
    if (major, minor) <= LAST_TORCHAUDIO:
        return f"Install the torchaudio release built for your torch {torch_version}: pip install 'torchaudio=={major}.{minor}.*'"
    last = "{}.{}".format(*LAST_TORCHAUDIO)
    return (f"torchaudio's releases end at {last}, and none is built for your torch {torch_version}: run the example "
            f"in an environment of its own with pip install 'torch=={last}.*' 'torchaudio=={last}.*'")


def _emformer_class():
    """torchaudio's `Emformer`, or exit saying what to install (torchaudio is not a flexkv dependency)."""
    try:
        from torchaudio.models import Emformer
    except (ImportError, OSError) as exc:  # OSError: a torchaudio built for another torch fails to load
        raise SystemExit(
            f"examples/emformer_memory_bank.py runs torchaudio's Emformer, and torchaudio cannot be imported "
            f"({str(exc).splitlines()[0]}). {torchaudio_hint(torch.__version__)} (flexkv itself does not need "
            f"torchaudio)"
        ) from None
    return Emformer


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--segments", type=int, default=100)
    ap.add_argument("--streams", type=int, default=3)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    Emformer = _emformer_class()

    torch.manual_seed(0)
    model = Emformer(64, 4, 128, 3, segment_length=4, left_context_length=8, right_context_length=2,
                     max_memory_size=3).eval()
    port = FlexkvEmformer(model, max_streams=args.streams)
    ids = list(range(args.streams))
    states = None
    worst = 0.0
    own_ms: List[float] = []
    flex_ms: List[float] = []
    with torch.no_grad():
        for s in range(args.segments):  # both run each segment, one after the other
            x = torch.randn(args.streams, 6, 64)
            t0 = time.perf_counter()
            want, _, states = model.infer(x, torch.full((args.streams,), 6), states)
            t1 = time.perf_counter()
            got = port.infer(ids, x)
            t2 = time.perf_counter()
            own_ms.append(1e3 * (t1 - t0))
            flex_ms.append(1e3 * (t2 - t1))
            worst = max(worst, float((got - want).abs().max()))
    own, flex = statistics.median(own_ms), statistics.median(flex_ms)
    print(f"{args.segments} segments x {args.streams} streams: largest |flexkv - Emformer.infer()| {worst:.2e}; "
          f"ms per segment (median) own {own:.2f}, flexkv {flex:.2f} ({flex / own:.2f}x; means {statistics.mean(own_ms):.2f} "
          f"and {statistics.mean(flex_ms):.2f}); state per stream: flexkv {port.memory_bytes_per_stream()} B, "
          f"the model's own {own_state_bytes(states)} B")


if __name__ == "__main__":
    main()
