"""A cache's device state: each layer's key and value buffers (`store`), quantized cells (`quantized`),
and whole-slot copies for forks and reorders (`slot_copy`)."""
