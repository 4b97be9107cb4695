"""A literal StreamingLLM cache, the reference for rotary in-cache positions (test helper)."""

import torch


class StreamingLLM:
    """StreamingLLM's cache, literally: un-rotated retained keys, re-rotated at every step (float64)."""

    def __init__(self, rotary, sink, window, scale):
        self.rotary, self.sink, self.window, self.scale = rotary, sink, window, scale
        self.keys, self.values = {}, {}

    def attend(self, layer, rid, q, k, v):
        """q [R, Hq, 1, D], k/v [R, H, 1, D] of one request; returns [R, Hq, 1, D]."""
        key = (rid, layer)
        K = torch.cat([self.keys.get(key, k[:, :, :0].double()), k.double()], dim=2)
        V = torch.cat([self.values.get(key, v[:, :, :0].double()), v.double()], dim=2)
        length = K.shape[2]
        Kr = self.rotary.rotate(K, torch.arange(length))  # every key, at its place in the cache
        qr = self.rotary.rotate(q.double(), torch.tensor([length - 1]))
        group = q.shape[1] // k.shape[1]
        Kr, V2 = Kr.repeat_interleave(group, 1), V.repeat_interleave(group, 1)
        out = torch.softmax(qr @ Kr.transpose(-1, -2) * self.scale, dim=-1) @ V2
        if length > self.sink + self.window:  # evict for the next step
            K = torch.cat([K[:, :, :self.sink], K[:, :, length - self.window:]], dim=2)
            V = torch.cat([V[:, :, :self.sink], V[:, :, length - self.window:]], dim=2)
        self.keys[key], self.values[key] = K, V
        return out

    def drop(self, rid):
        for key in [key for key in self.keys if key[0] == rid]:
            del self.keys[key], self.values[key]
