"""The workbench: instruments that tune and probe loopserve's kernels and decode step, run from a
checkout (`python -m benchmarks.NAME`), never installed. README.md beside this file lists them."""
