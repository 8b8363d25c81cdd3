"""Suite-wide environment: a private, empty profile cache and no automatic measurement by `plan`.

`plan MODEL --cluster Nxcpu` measures a small model on this host by itself when nothing is cached
(profiler/source.py); in the tests that would add tens of seconds to every CPU plan and make predictions
depend on what the user's ~/.cache/meshplan holds. Tests that exercise the measurement turn it back on.
Set in os.environ so that subprocesses (plan, torchrun) inherit it.
"""

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_profile_cache(tmp_path_factory):
    saved = {key: os.environ.get(key) for key in ("MESHPLAN_CACHE", "MESHPLAN_AUTO_PROFILE")}
    os.environ["MESHPLAN_CACHE"] = str(tmp_path_factory.mktemp("meshplan-cache"))
    os.environ["MESHPLAN_AUTO_PROFILE"] = "0"
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
