"""The rows path's CPU fast paths: `FastRowsPath` (`fast_rows_path`), chosen once by
`flexkv.cache.path_choice` unless `AttentionOptions.cpu_fast_paths` is off, over the fast paths themselves
(`cpu_fast_rows`), group buffers (`gathered_rows`) and quantized cells widened inside one op
(`quantized_rows`). They build on the plain rows path's pieces (`rows_path`, `row_attention`, `row_cells`)
and nothing else of the paths."""
