"""Classifier-free guidance as pipelines write it: every request's conditional row, then every request's
unconditional row (`torch.cat([x_cond, x_uncond])`), and a per-request speaker embedding fed once per
request (`PerRequest`), not repeated over the tokens.

The model is run twice over the same requests: written the pipeline's way (stacked rows, `rows="stacked"`,
the embedding as `PerRequest`), and written in flexkv's row order with the embedding repeated over every
token. Both must give the same output, step after step, with requests joining late.
"""

import pytest
import torch
from random_workload import check_close
from torch import nn

from flexkv import BoundedKVConfig, PerRequest, SinkWindow, StreamSession
from flexkv.model.wrap import attention, rows_by_request, rows_stacked
from single_thread import one_thread  # noqa: F401  (autouse: one torch thread per module)

E, HEADS, HD, T, LAYERS = 16, 2, 8, 4, 2


def config():
    return BoundedKVConfig(num_layers=LAYERS, num_heads=HEADS, head_dim=HD, rows_per_request=2, max_source_len=0,
                           max_sources=0, retention=SinkWindow(1, 6), max_slots=3, max_step_tokens=T)


class CFGModel(nn.Module):
    def __init__(self, context, stacked: bool):
        super().__init__()
        torch.manual_seed(0)
        self.stacked = stacked
        self.qkv = nn.ModuleList([nn.Linear(E, 3 * E) for _ in range(LAYERS)])
        self.cores = [attention(context, i, rows="stacked" if stacked else "request") for i in range(LAYERS)]

    def forward(self, x, speaker):  # x [B, T, E]; speaker [B, E] (stacked) or [B, T, E] (repeated)
        B = x.shape[0]
        spk = speaker.unsqueeze(1) if self.stacked else speaker
        cond, uncond = x + spk, x
        if self.stacked:
            h = torch.cat([cond, uncond])  # [2B, T, E]: all conditional rows, then all unconditional
        else:
            h = torch.stack([cond, uncond], dim=1).flatten(0, 1)  # [B * 2, T, E]: request by request
        for qkv, core in zip(self.qkv, self.cores):
            q, k, v = qkv(h).view(2 * B, T, 3, HEADS, HD).permute(2, 0, 3, 1, 4)
            h = h + core(q, k, v).transpose(1, 2).flatten(2)
        c, u = (h[:B], h[B:]) if self.stacked else (h[0::2], h[1::2])
        return u + 2.0 * (c - u)


def test_stacked_cfg_rows_and_a_per_request_embedding_match_flexkvs_row_order():
    sessions = [StreamSession(config(), compile=False, token_sizes=(T,)) for _ in range(3)]
    models = [CFGModel(sessions[0].context, True), CFGModel(sessions[1].context, False),
              CFGModel(sessions[2].context, False)]
    fns = [lambda attn, inp, m=models[0]: m(*inp), lambda attn, inp, m=models[1]: m(*inp),
           lambda attn, inp, m=models[2]: m(*inp)]
    g = torch.Generator().manual_seed(1)
    speakers = {rid: torch.randn(E, generator=g) for rid in "abc"}
    unmapped = 0.0
    for s in range(6):
        rids = "ab" if s < 2 else "abc"  # c joins late
        xs = {rid: torch.randn(T, E, generator=g) for rid in rids}
        got = sessions[0].step({r: (xs[r], PerRequest(speakers[r])) for r in rids}, fns[0])
        want = sessions[1].step({r: (xs[r], speakers[r].expand(T, E)) for r in rids}, fns[1])
        # the pipeline's stacked rows fed to a core in flexkv's row order: rows attend other requests' caches
        models[2].stacked = True
        try:
            wrong = sessions[2].step({r: (xs[r], PerRequest(speakers[r])) for r in rids}, fns[2])
        finally:
            models[2].stacked = False
        for r in rids:
            check_close(got[r], want[r], 1e-5, f"step {s}, request {r!r}")
            unmapped = max(unmapped, (wrong[r] - want[r]).abs().max().item())
    assert unmapped > 1e-2  # the negative control: rows fed in the wrong order do differ


def test_row_order_helpers_are_inverse():
    x = torch.arange(12).view(6, 2)  # B = 3 requests x R = 2 rows, stacked: rows r * 3 + lane
    by_request = rows_by_request(x, 2)
    assert by_request[:, 0].tolist() == [0, 6, 2, 8, 4, 10]  # lane 0 cond, lane 0 uncond, lane 1 cond, ...
    assert torch.equal(rows_stacked(by_request, 2), x)
    with pytest.raises(ValueError, match="rows must be one of"):
        attention(StreamSession(config(), compile=False).context, 0, rows="cfg")


def test_a_per_request_tensor_has_no_token_dimension_to_agree_on():
    session = StreamSession(config(), compile=False, token_sizes=(T,))
    m = CFGModel(session.context, True)
    out = session.step({"a": (torch.randn(T, E), PerRequest(torch.randn(E)))}, lambda attn, inp: m(*inp))
    assert out["a"].shape == (T, E)
    with pytest.raises(ValueError, match=r"holds no tensor with tokens \(only PerRequest ones\)"):
        session.step({"a": (PerRequest(torch.randn(E)),)}, lambda attn, inp: m(*inp))
    with pytest.raises(ValueError, match=r"requests 'a' and 'b' feed differently shaped inputs"):
        session.step({"a": (torch.randn(T, E), PerRequest(torch.randn(E))),
                      "b": (torch.randn(T, E), PerRequest(torch.randn(E + 1)))}, lambda attn, inp: m(*inp))
