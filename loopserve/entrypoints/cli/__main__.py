"""`python -m loopserve.entrypoints.cli` runs the `loopserve` command (no install needed)."""

import sys

from loopserve.entrypoints.cli import main

if __name__ == "__main__":  # not when a spawned process (`serve`'s engine process) imports it
    sys.exit(main())
