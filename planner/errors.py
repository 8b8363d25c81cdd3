"""Errors that the CLI turns into one-line messages and exit codes (DESIGN.md §2)."""


class MeshplanError(Exception):
    """Base class: a user-facing error with an exit code, never shown as a traceback."""

    exit_code = 1


class InputError(MeshplanError):
    """Bad input: the message names the field and what was expected (exit 2)."""

    exit_code = 2


class InfeasibleError(MeshplanError):
    """No plan fits in memory: the message says by how much and what would make it fit (exit 3)."""

    exit_code = 3
