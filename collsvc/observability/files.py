"""Reading the JSON files ranks leave behind (timeline parts, flight-recorder dumps)."""

from __future__ import annotations

import json
import os
from typing import Any


def read_json(path: str) -> tuple[Any, float] | None:
    """``(the parsed file, its modification time)``, or None when it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        return data, os.path.getmtime(path)
    except (OSError, ValueError):
        return None
