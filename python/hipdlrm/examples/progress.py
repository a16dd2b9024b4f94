"""A dependency-free progress bar for training loops.

On a terminal it redraws one line in place (``\\r``); when stderr is a file or a pipe (CI logs, remote
runs) it prints a plain line about every tenth of the run instead, so logs stay readable.
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


def format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressBar:
    """``label [#######.......]  70/100  loss 0.4821  12,345 ex/s  eta 0:07``.

    ``update(done, **fields)`` reports that ``done`` of ``total`` steps are finished; ``fields`` are
    shown after the counter (floats with 4 significant digits, ints with thousands separators).
    """

    def __init__(self, total: int, label: str, start: int = 0, width: int = 28,
                 stream: Optional[TextIO] = None) -> None:
        self.total, self.label, self.width = max(1, total), label, width
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start_done = start
        self.started = time.perf_counter()
        self.next_line_at = start
        self.last_len = 0

    def _render(self, done: int, fields: dict) -> str:
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        parts = [f"{self.label} [{bar}] {done:>{len(str(self.total))}}/{self.total}"]
        for key, value in fields.items():
            if isinstance(value, float):
                parts.append(f"{key} {value:,.0f}" if abs(value) >= 1000 else f"{key} {value:.4g}")
            else:
                parts.append(f"{key} {value:,}" if isinstance(value, int) else f"{key} {value}")
        elapsed = time.perf_counter() - self.started
        if done > self.start_done and done < self.total:
            parts.append("eta " + format_duration(elapsed / (done - self.start_done) * (self.total - done)))
        elif done >= self.total:
            parts.append("took " + format_duration(elapsed))
        return "  ".join(parts)

    def update(self, done: int, **fields) -> None:
        line = self._render(done, fields)
        if self.interactive:
            self.stream.write("\r" + line + " " * max(0, self.last_len - len(line)))
            self.last_len = len(line)
            if done >= self.total:
                self.stream.write("\n")
        elif done >= self.next_line_at or done >= self.total:
            self.stream.write(line + "\n")
            self.next_line_at = done + max(1, self.total // 10)
        self.stream.flush()
