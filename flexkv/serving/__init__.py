"""The seams to a serving engine: declaring and building caches (`engine`), and tensor-parallel
caches that hold one rank's share of the KV heads (`distributed`)."""
