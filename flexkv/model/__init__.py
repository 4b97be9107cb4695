"""The model side: putting a cache under a model's attention (`wrap`, `port`), the dense
whole-stream reference (`reference`) and the uncached twin built on it (`uncached`)."""
