"""Keeping the garbage collector's full collections off what start-up built.

Owns: `objects_frozen`, entered once the model has loaded by the server's process and by the
engine's process (the default; `--no-engine-process` keeps the engine in the server's). Must not:
import the app or the engine.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def objects_frozen() -> Iterator[None]:
    """Exempt every object that exists now from the garbage collector's full collections until
    the block ends. The server enters it once the model has loaded (torch, the model, the app:
    ~330,000 objects on a tokenizer-less checkpoint). A collection holds the interpreter lock,
    and so stalls the engine thread, for as long as it takes: ~140 ms each on the 2-core CPU box
    (one every ~14 s of serving at C=128), ~5 ms with them frozen. Objects freed by reference
    counting still are. Unfrozen on the way out, so the interpreter's exit frees them
    (extensions such as Triton's report what it did not)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
