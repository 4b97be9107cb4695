"""The host side of a cache: plain Python and integers, never a device read.

Where every entry lives (`layout`), the slot table and its checks (`slots`),
what a cache answers from its table alone (`table_views`), what a source is
(`sources`), a step as one small integer table (`planner`), the lifecycle
written once over a table and its stores (`lifecycle`), and one model step,
whole or not at all (`transaction`). Nothing here imports an attention path.
"""
