"""Reading and writing the JSON files every part exchanges (config.json, profiles, plans)."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from meshplan.planner.errors import InputError


def read_json(path: str, what: str) -> Any:
    """Parse a JSON file; a missing or malformed file is one InputError naming `what` (e.g. "PLAN")."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise InputError(f"{what}: cannot read '{path}': {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{what}: '{path}' is not valid JSON: {exc}") from None


def write_atomic(path: str, text: str) -> None:
    """Write through a temporary file and a rename, so a reader never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".meshplan-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
