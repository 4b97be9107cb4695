"""torchaudio's Emformer streamed on flexkv (`examples/emformer_memory_bank.py`) against its own `infer()`.

Each layer's frames, look-ahead and memory bank are one attention call: two
flexkv caches and the look-ahead's keys in one softmax (the joint path); the check is the
model's own streaming inference, segment by segment, with a stream that
joins later than the others. Needs torchaudio (skipped without it).
"""

import pytest
import torch

torchaudio_models = pytest.importorskip("torchaudio.models", reason="torchaudio is not installed")

from examples.emformer_memory_bank import FlexkvEmformer, own_state_bytes  # noqa: E402
from single_thread import one_thread  # noqa: E402,F401

U, R, D = 4, 2, 32


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return torchaudio_models.Emformer(D, 4, 64, 2, segment_length=U, left_context_length=6, right_context_length=R,
                                      max_memory_size=2).eval()


def test_every_segment_matches_the_models_own_streaming_inference(model):
    port = FlexkvEmformer(model, max_streams=3)
    g = torch.Generator().manual_seed(1)
    states = late_states = None
    with torch.no_grad():
        for s in range(9):
            x = torch.randn(3, U + R, D, generator=g)
            want, _, states = model.infer(x[:2], torch.full((2,), U + R), states)
            if s >= 3:  # stream 2 starts at segment 3, with a state of its own
                late, _, late_states = model.infer(x[2:], torch.full((1,), U + R), late_states)
                want = torch.cat([want, late])
            ids = [0, 1, 2] if s >= 3 else [0, 1]
            got = port.infer(ids, x[:len(ids)])
            torch.testing.assert_close(got, want, rtol=0, atol=5e-6, msg=f"segment {s}")
    # Both rings and both banks wrapped; the memory is the slot of each cache.
    assert 9 * U > 2 * (6 + U) and port.bank.written(0) > 2 * 2
    assert port.memory_bytes_per_stream() == port.frames.slot_bytes + port.bank.slot_bytes
    assert own_state_bytes(states) > 0


def test_the_bank_matters(model):
    """Without the bank part the outputs drift from the model's (the test above is not vacuous)."""
    port = FlexkvEmformer(model, max_streams=1)
    port.pending = _Forgetful()
    g = torch.Generator().manual_seed(1)
    states, worst = None, 0.0
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(1, U + R, D, generator=g)
            want, _, states = model.infer(x, torch.full((1,), U + R), states)
            worst = max(worst, float((port.infer([0], x) - want).abs().max()))
    assert worst > 1e-2


class _Forgetful(dict):
    """A pending-entry store that never holds anything: no bank step ever runs."""

    def __setitem__(self, key, value):
        pass


class _Boom(Exception):
    pass


@pytest.mark.parametrize("fail_at", [0, 2])
def test_a_segment_that_fails_midway_leaves_both_caches_as_they_were(model, fail_at):
    """An exception in the last layer, after both caches' earlier layers wrote, takes the whole segment
    back in both caches (a first segment's new streams leave both); run again, it gives the model's
    own output."""
    port = FlexkvEmformer(model, max_streams=2)
    g = torch.Generator().manual_seed(2)
    states = None
    with torch.no_grad():
        for s in range(4):
            x = torch.randn(2, U + R, D, generator=g)
            want, _, states = model.infer(x, torch.full((2,), U + R), states)
            if s == fail_at:
                before = {name: (c.requests, [c.written(r) for r in c.requests])
                          for name, c in (("frames", port.frames), ("bank", port.bank))}
                last = port.model.emformer_layers[-1].attention
                real = last.out_proj.forward
                last.out_proj.forward = lambda *a: (_ for _ in ()).throw(_Boom())
                with pytest.raises(_Boom):
                    port.infer([0, 1], x)
                last.out_proj.forward = real
                after = {name: (c.requests, [c.written(r) for r in c.requests])
                         for name, c in (("frames", port.frames), ("bank", port.bank))}
                assert after == before
            got = port.infer([0, 1], x)
            torch.testing.assert_close(got, want, rtol=0, atol=5e-6, msg=f"segment {s}")
