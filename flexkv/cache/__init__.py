"""The cache: where every entry lives (`layout`), the host planner (`planner`), retention as
FlexAttention masks (`masks`), the attention paths (`row_attention` with `row_cells` and
`gathered_rows`, `kernel_options`, `kernel_sharing`), learned sinks (`sinks`), quantized slots
(`quantized`), rotary positions (`rotary`), relative positions (`relative_position`), the slot pool and its step
(`manager`), layer groups (`groups`) and the protocol every cache meets (`protocol`)."""
