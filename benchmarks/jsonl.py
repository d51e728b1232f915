"""How a workbench instrument reports: one JSON line per record, printed and, with `--out`,
appended to that file (so several runs can share one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(record: dict[str, Any], out: Path | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if out is not None:
        with out.open("a") as sink:
            sink.write(line + "\n")
