"""Reading and writing the tune command's JSON tables in the user cache (see ``hkernels.configs``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hkernels import configs


def read(path: Path) -> dict[str, Any]:
    """The table at ``path``; missing: empty; unreadable: a warning, then empty (it is rewritten whole)."""
    return configs._read(path)


def write(path: Path, table: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, indent=1) + "\n")
    tmp.replace(path)  # readers never see half a file


def merge_buckets(path: Path, kernel: str, bucket: dict[str, Any]) -> None:
    """Put ``bucket`` first in ``kernel``'s list at ``path``, replacing one for the same n range and dtypes."""
    table = read(path)
    same = (bucket["min_n"], bucket["max_n"], bucket["dtypes"])
    kept = [b for b in table.get(kernel, []) if (b.get("min_n", 0), b["max_n"], b.get("dtypes")) != same]
    table[kernel] = [bucket, *kept]
    write(path, table)
