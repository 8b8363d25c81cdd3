"""Progress of a long measurement: a rich bar on a terminal, one plain line per step otherwise."""

from __future__ import annotations

import sys


class Reporter:
    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled
        self._progress = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("profiling"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.description}"),
                                      console=Console(stderr=True))
            self._task = self._progress.add_task("", total=total)
            self._progress.start()

    def step(self, label: str) -> None:
        """Announce the step about to run (which layer, which size)."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done, description=label)
        else:
            print(f"profile [{self.done + 1}/{self.total}] {label}", file=sys.stderr, flush=True)
        self.done += 1

    def close(self) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done)
            self._progress.stop()
            self._progress = None
