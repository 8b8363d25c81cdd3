"""meshplan planner: specs, cost model, search and the `plan` command line."""

__version__ = "0.2.6"
