"""`python -m prefixgate ...`: the `prefixgate` command."""

import sys

from prefixgate.cli import main

sys.exit(main())
