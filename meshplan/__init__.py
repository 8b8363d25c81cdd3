"""meshplan: an automatic parallelism planner for training large models with PyTorch.

The three parts live in the repository's top-level folders and install as `meshplan.profiler`,
`meshplan.planner` and `meshplan.executor` (pyproject.toml maps them).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("meshplan")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
