"""Measured profiles cached by (model dimensions, device, dtype, concurrent ranks, versions).

A second `plan` on the same machine reuses a measurement instead of repeating it; a new torch,
meshplan or profile schema version, another device or another number of CPU ranks sharing the cores
gives another key, so a stale measurement is never picked up. `plan profile --force` re-measures.
Directory: $MESHPLAN_CACHE, else ~/.cache/meshplan.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

import torch
from meshplan.planner import __version__ as meshplan_version
from meshplan.planner.errors import InputError
from meshplan.planner.model_spec import ModelSpec
from meshplan.profiler.profile import SCHEMA_VERSION, Profile, load_profile, same_model, save_profile


def cache_dir() -> str:
    return os.environ.get("MESHPLAN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "meshplan")


def cache_key(model: ModelSpec, device_name: str, dtype: str, concurrent_ranks: int) -> str:
    dims = model.to_dict()
    dims.pop("name")
    ident = {"model": dims, "device": device_name, "dtype": dtype, "concurrent_ranks": concurrent_ranks,
             "torch": torch.__version__, "meshplan": meshplan_version, "schema": SCHEMA_VERSION}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(model: ModelSpec, device_name: str, dtype: str, concurrent_ranks: int) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model.name)[:60]
    key = cache_key(model, device_name, dtype, concurrent_ranks)
    return os.path.join(cache_dir(), "profiles", f"{safe}-{dtype}-x{concurrent_ranks}-{key}.json")


def load_cached(model: ModelSpec, device_name: str, dtype: str, concurrent_ranks: int) -> Profile | None:
    """The cached measured profile, or None. A cache file that no longer reads as this model's profile
    (edited, truncated, older schema) is reported on stderr and ignored, never used."""
    path = cache_path(model, device_name, dtype, concurrent_ranks)
    if not os.path.isfile(path):
        return None
    try:
        profile = load_profile(path, model=model)
    except InputError as exc:
        print(f"plan: ignoring cached profile {path}: {exc}", file=sys.stderr)
        return None
    if profile.dtype != dtype or profile.torch_version != torch.__version__ or not same_model(profile.model, model):
        return None
    return profile


def store(profile: Profile) -> str:
    path = cache_path(profile.model, profile.device_name, profile.dtype, profile.concurrent_ranks)
    save_profile(profile, path)
    return path
