"""Benchmarks of flexkv against the caches users write today (not part of the test suite)."""
