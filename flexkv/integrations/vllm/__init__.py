"""flexkv for vLLM: sink + window retention with bounded blocks, loaded as a vLLM plugin.

Installing `flexkv[vllm]` registers `register` under vLLM's `vllm.general_plugins` entry point;
vLLM calls it in every process it starts. Nothing changes until an engine is configured with
`additional_config={"flexkv": {"sink": S, "window": W}}`: then every full-attention decoder layer
keeps its stream's first `S` tokens and its last `W` tokens before each query (flexkv's
`SinkWindow(S, W)` with a per-query window, contract section 2), blocks wholly between the two go
back to vLLM's block pool as a request advances, and attention reads only what is kept.

Modules: `options` (reading and checking the `flexkv` entry of `additional_config`, and what is
refused, and which positions are served), `spec` (the KV-cache spec and block manager), `cpu_layout`
(reading vLLM's CPU cache layout), `backend` (the CPU attention backend),
`retention_mask` (the retention as vLLM's FlexAttention metadata reads it), `flex_backend` (the
FlexAttention backend, for CUDA), `plugin` (what `register` installs into vLLM). docs/vllm.md is the full description.
"""

__all__ = ["register"]


def register() -> None:
    """vLLM's `vllm.general_plugins` entry point: install the spec, its manager and the backend."""
    from .plugin import install

    install()
