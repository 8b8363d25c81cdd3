"""Profile JSON (filled in by the Profiler issue)."""

from __future__ import annotations

import os

from planner.errors import InputError


def load_profile(path: str, model=None):
    if not os.path.exists(path):
        raise InputError(f"--profile: cannot read '{path}': no such file")
    raise InputError("--profile: reading profiles is not implemented yet in this version of meshplan")
