"""Triton's CPU interpreter without its repeated re-patching of `triton.language`.

Under TRITON_INTERPRET=1 a kernel launch (`GridExecutor.__call__`) swaps `triton.language`'s
builtins for interpreted ones (`_patch_lang`) and swaps them back when the grid is done. Every call
of a `@triton.jit` helper inside the kernel (`InterpretedFunction.__call__`) runs `_patch_lang`
again, for every program of the grid: it walks every member of `tl`, `tl.core`, `tl.math` and
`tl.tensor` (`inspect.getmembers`), finds the builtins already swapped, and sets the same
stateless closures (`range`, `static_assert`, `reduce`...) once more. Nothing of that changes what
runs; it is about a sixth of the CPU kernel tests' time, more on the decode kernels, which call
helpers per tile (the four batch-invariance cases: 41 s -> 31 s; tests/kernels about 45 s).

`install` skips the repeat: during a launch, a helper's `_patch_lang` runs only if the helper's
module sees a language module (`tl`, `tl.core`) that this launch has not patched yet; the launch's
own patch and its restore are triton's, unchanged. Where triton lacks these internals (another
version), nothing is installed and the tests run as before, only slower.
"""

from __future__ import annotations

import inspect
from typing import Any


def install() -> bool:
    """Install the skip (once); whether it is installed."""
    import triton.language as tl
    from triton.runtime import interpreter

    needed = ("_patch_lang", "_LangPatchScope", "GridExecutor", "InterpretedFunction")
    if not all(hasattr(interpreter, name) for name in needed):
        return False
    if getattr(interpreter._patch_lang, "_skips_repeats", False):
        return True
    patch_lang = interpreter._patch_lang
    launch = interpreter.GridExecutor.__call__
    # Language modules patched by the launch running now (None: no launch is running).
    patched: list[frozenset[int] | None] = [None]

    def languages(fn: Any) -> frozenset[int]:
        return frozenset(
            id(value)
            for value in fn.__globals__.values()
            if inspect.ismodule(value) and value in (tl, tl.core)
        )

    def patch_once_per_launch(fn: Any) -> Any:
        if patched[0] is not None:
            wanted = languages(fn)
            if wanted and wanted <= patched[0]:  # (none visible: triton's own check fails it)
                return interpreter._LangPatchScope()  # already in place: nothing to undo
            patched[0] |= wanted
        return patch_lang(fn)

    def launch_tracking(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer, patched[0] = patched[0], frozenset()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched[0] = outer

    patch_once_per_launch._skips_repeats = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_once_per_launch
    interpreter.GridExecutor.__call__ = launch_tracking
    return True
