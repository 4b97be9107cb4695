"""Adapters that run flexkv inside other libraries.

Each adapter is its own module with its own optional dependency; nothing here
is imported by `flexkv` itself, so the core needs only torch and pyyaml.

- `flexkv.integrations.transformers`: a bounded sink + window cache for
  Hugging Face transformers (`pip install 'flexkv[transformers]'`).
"""

__all__: list = []
