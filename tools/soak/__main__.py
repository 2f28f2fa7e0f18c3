"""`python -m tools.soak ...`: see `tools/soak/__init__.py`."""

from __future__ import annotations

import sys

from tools.soak.cli import main

if __name__ == "__main__":
    sys.exit(main())
