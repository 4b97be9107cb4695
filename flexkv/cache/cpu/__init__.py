"""The rows path's CPU fast paths, behind one boundary (`cpu_fast_rows`, entered from
`flexkv.cache.paths.rows_path` unless `AttentionOptions.cpu_fast_paths` is off): group buffers
(`gathered_rows`) and quantized cells widened inside one op (`quantized_rows`). They build on the plain
path's pieces (`row_attention`, `row_cells`) and nothing else of the paths."""
