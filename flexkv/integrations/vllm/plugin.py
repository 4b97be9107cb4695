"""What `register` installs into vLLM, in every process vLLM starts.

- `SinkWindowSpec` and `SinkWindowManager` in vLLM's KV-cache spec registry
  (`KVCacheSpecRegistry.register`), as a kind of layer of their own;
- `FlexKVCPUBackend` as the class behind `AttentionBackendEnum.CPU_ATTN` (`register_backend`):
  vLLM's CPU platform selects no other backend, so the CPU backend itself is what a plugin replaces;
- on a CUDA platform, `FlexKVFlexAttentionBackend` as the class behind
  `AttentionBackendEnum.FLEX_ATTENTION` (the engine selects it with
  `attention_config={"backend": "FLEX_ATTENTION"}`); it has not run on a GPU;
- a wrapper of `Attention.get_kv_cache_spec`: a layer whose implementation keeps a flexkv
  retention reports a `SinkWindowSpec` instead of vLLM's full-attention spec. vLLM offers no hook
  for this; every other layer reports what vLLM's own method says;
- a wrapper of `VllmConfig.__post_init__`: an engine's configuration with the `flexkv` entry is
  checked (`options.check_engine`) where it is made, so a bad entry or a refused setting stops
  `vllm serve`'s front-end process with flexkv's message, not only its engine core;
- a wrapper of `RotaryEmbeddingBase.__init__`: in an engine with the `flexkv` entry, the rotary
  table of a rope type in `options.SERVED_ROPE` covers `max_model_len` positions (its rows past the
  model's own length are the same formula's next rows), so a stream longer than the model's
  `max_position_embeddings` is rotated by real angles, never read past the table's end. The angles
  of a plain or llama3 table are computed in float64 (vLLM's float32 `position * frequency` is off
  by up to `position * 6e-8` radians: 1.5e-3 at 24,576, where in-cache positions would have been
  exact). Other rope types keep their table, and an engine whose streams would outrun it is
  refused (`options.refusals`);
- a wrapper of `InputProcessor.process_inputs` (where each request arrives, in the front-end process): a
  request whose `extra_args` names a retention of its own (`options.request_retention`) is checked against
  the engine's, which is the most it may keep, and refused with the reason where it cannot be served; a
  served one gets a prefix-cache salt of its retention, so it never resumes from blocks that requests of
  another retention computed (past the first eviction their keys and values differ);
- a wrapper of `GPUModelRunner._build_attention_metadata` (vLLM's CPU model runner is one): where some
  request of the step has a retention of its own, each step's attention metadata carries every row's
  sink and window (`flexkv_rows`), which `FlexKVCPUImpl` attends by.

Calling `install` again changes nothing (vLLM may load plugins more than once).
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["install"]


_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    from vllm.config import VllmConfig, get_current_vllm_config_or_none
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from .backend import FlexKVCPUImpl
    from .options import check_engine
    from .requests import install_request_retention
    from .rope import served_rope_classes
    from .spec import SinkWindowManager, SinkWindowSpec

    # vLLM registers its own specs only when the registry is empty: fill it first.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(SinkWindowSpec, SinkWindowManager, uniform_type_base_spec=SinkWindowSpec)
    register_backend(AttentionBackendEnum.CPU_ATTN, "flexkv.integrations.vllm.backend.FlexKVCPUBackend")
    impls = (FlexKVCPUImpl,)  # the implementations that keep a flexkv retention
    if current_platform.is_cuda_alike():
        register_backend(AttentionBackendEnum.FLEX_ATTENTION,
                         "flexkv.integrations.vllm.flex_backend.FlexKVFlexAttentionBackend")
        from .flex_backend import FlexKVFlexAttentionImpl

        impls += (FlexKVFlexAttentionImpl,)

    own = Attention.get_kv_cache_spec

    def get_kv_cache_spec(self, vllm_config):
        spec = own(self, vllm_config)
        impl = getattr(self, "impl", None)
        if not isinstance(impl, impls):
            if isinstance(spec, FullAttentionSpec) and check_engine(vllm_config) is not None:
                raise ValueError(
                    f"flexkv cannot serve additional_config['flexkv'] for layer {self.layer_name}: its attention "
                    f"backend is {type(impl).__name__}, and flexkv's retention runs in vLLM's CPU backend and, on "
                    f"CUDA, in its FlexAttention backend (attention_config={{'backend': 'FLEX_ATTENTION'}})"
                )
            return spec
        pol = impl.retention
        if pol is None or isinstance(spec, SlidingWindowSpec):
            return spec
        if type(spec) is not FullAttentionSpec:
            raise ValueError(f"flexkv cannot serve {pol!r} for layer {self.layer_name}: vLLM describes its cache as "
                             f"{type(spec).__name__}, and flexkv bounds plain full-attention layers only")
        # vLLM's own fields as vLLM filled them (a newer vLLM's new fields included), the window and sinks set here
        own_fields = {f.name for f in dataclasses.fields(spec)}
        carried = {f.name: getattr(spec, f.name) for f in dataclasses.fields(SinkWindowSpec)
                   if f.init and f.name in own_fields and f.name != "sliding_window"}
        return SinkWindowSpec(**carried, sliding_window=pol.window + 1, sink=pol.sink,
                              scratch=getattr(impl, "scratch_blocks", 0))

    get_kv_cache_spec.__wrapped__ = own
    Attention.get_kv_cache_spec = get_kv_cache_spec

    own_rope_init = RotaryEmbeddingBase.__init__
    lengthened = served_rope_classes()

    def rope_init(self, head_size, rotary_dim, max_position_embeddings, *args, **kwargs):
        cfg = get_current_vllm_config_or_none()
        ours = cfg is not None and type(self) in lengthened and check_engine(cfg) is not None
        if ours:
            max_position_embeddings = max(max_position_embeddings, cfg.model_config.max_model_len)
        own_rope_init(self, head_size, rotary_dim, max_position_embeddings, *args, **kwargs)
        # a table from vLLM's base formula (plain, llama3: cos and sin of position x frequency) again in float64
        base_rows = type(self)._compute_cos_sin_cache is RotaryEmbeddingBase._compute_cos_sin_cache
        if ours and base_rows and getattr(self, "cos_sin_cache", None) is not None:
            inv_freq = self._compute_inv_freq(self.base).double()
            t = torch.arange(self.max_position_embeddings, dtype=torch.float64)
            angles = torch.outer(t, inv_freq)
            table = torch.cat((angles.cos(), angles.sin()), dim=-1)
            self.cos_sin_cache.copy_(table.to(self.cos_sin_cache.dtype))

    rope_init.__wrapped__ = own_rope_init
    RotaryEmbeddingBase.__init__ = rope_init

    own_post_init = VllmConfig.__post_init__

    def post_init(self, *args, **kwargs):
        own_post_init(self, *args, **kwargs)
        if getattr(self, "model_config", None) is not None:
            check_engine(self)  # raises, naming every reason, where the engine cannot be served exactly

    post_init.__wrapped__ = own_post_init
    VllmConfig.__post_init__ = post_init

    install_request_retention()
    _installed = True
