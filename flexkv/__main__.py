"""`python -m flexkv` is the `flexkv` command (see flexkv.cli)."""

import sys

from .cli import main

sys.exit(main())
