"""`python -m loopserve.entrypoints.cli` runs the `loopserve` command (no install needed)."""

import sys

from loopserve.entrypoints.cli import main

sys.exit(main())
