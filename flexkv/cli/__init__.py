"""`flexkv run` and `flexkv show`: a streaming workload's description (`workload`), the attention
model and traffic it drives (`stream_model`, `traffic`), the run and its report (`runner`), what one
step attends (`show`), and the command line (`commands`)."""

from .commands import main

__all__ = ["main"]
