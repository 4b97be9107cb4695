"""A cache's attention paths (`flexkv.cache.path_choice`, above them, chooses one per call).

The FlexAttention path (`flex_path` over `flex_call`, `kernel_options`,
`kernel_sharing`; `float8_path`), the rows path's plain reference
(`rows_path` over `row_attention` and `row_cells`), the joint path
(`joint_path`: keys kept elsewhere in one softmax), query-only queries
(`query_only`), learned sinks (`sinks`), merging softmaxes (`merge`), and how
a cache computes attention (`attention_options`). A path reads the host's
layout and plan, never its tables; the CPU speed work lives in `cpu`, above
the paths (it builds on the rows path's pieces), and `flexkv.cache.path_choice`
is the one module that enters it.
"""
