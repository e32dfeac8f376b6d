"""Progress on stderr for work that takes a while: ``butter bench``/``quality`` runs, a long
prompt's prefill, a model's first conversion."""

from __future__ import annotations

import time
from typing import TextIO


class Progress:
    """A progress bar: ``bench [#########-----------] 5/12 affine8 @ 1024``.

    Redrawn in place on a terminal; elsewhere (a log file, a test) one line per step;
    with ``stream=None``, silent. With ``delay``, nothing is drawn until that many seconds
    have passed since the bar was made, so work that finishes quickly stays quiet.
    """

    def __init__(self, total: int, title: str, stream: TextIO | None, width: int = 20, *, delay: float = 0.0):
        self.total, self.title, self.width = total, title, width
        self.stream = stream
        self.done = 0
        self.in_place = stream is not None and stream.isatty()
        self.shows_after = time.perf_counter() + delay
        self.drawn = False
        self.finished = False

    def step(self, label: str) -> None:
        """Show that the step ``label`` starts (``done`` steps are finished)."""
        self._draw(label)
        self.done += 1

    def advance_to(self, done: int, label: str = "") -> None:
        """Show that ``done`` of ``total`` are finished."""
        self.done = done
        self._draw(label)

    def finish(self) -> None:
        """Draw the full bar and end the line (once; nothing if the bar never showed)."""
        if not self.drawn or self.finished:
            return
        self.done = self.total
        self._draw("done")
        self.finished = True
        if self.in_place:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, label: str) -> None:
        if self.stream is None or (not self.drawn and time.perf_counter() < self.shows_after):
            return
        self.drawn = True
        filled = self.width * self.done // max(self.total, 1)
        line = f"{self.title} [{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total} {label}".rstrip()
        self.stream.write(f"\r{line}\x1b[K" if self.in_place else line + "\n")
        self.stream.flush()
