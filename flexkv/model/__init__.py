"""The model side: putting a cache under a model's attention (`wrap`, `port`), the dense
whole-stream reference (`reference`) and the uncached twin built on it (`uncached`)."""

# A context over named caches is `StepContext({...})`, whose class is defined here: importing it names it.
from . import multi_context  # noqa: E402,F401
