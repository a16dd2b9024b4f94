"""Training progress on stderr, through tqdm (the ``examples`` extra, imported on first use).

Two forms, as training scripts show them: on a terminal a tqdm bar redrawn in place; in a log (stderr a
file or a pipe: CI, remote runs) the same line printed about every tenth of the run, since a bar redrawn
with carriage returns makes a log unreadable. ``mode`` picks one: "auto" (by whether stderr is a
terminal), "bar", "log" or "off".
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

MODES = ("auto", "bar", "log", "off")


def require_tqdm():
    """The tqdm class, or an ImportError saying how to get it."""
    try:
        from tqdm import tqdm
    except ImportError as e:
        raise ImportError(
            "the training example shows its progress with tqdm, which is not installed: "
            "pip install 'tqdm' (or the example's extra, pip install 'hipdlrm[examples]'; bash scripts/setup.sh "
            "installs it), or run with --progress off") from e
    return tqdm


def format_fields(fields: dict) -> str:
    """``loss 0.4821  ex/s 12,345``: floats with 4 significant digits (thousands separated from 1000 on),
    ints with thousands separators."""
    parts = []
    for key, value in fields.items():
        if isinstance(value, float):
            parts.append(f"{key} {value:,.0f}" if abs(value) >= 1000 else f"{key} {value:.4g}")
        elif isinstance(value, int):
            parts.append(f"{key} {value:,}")
        else:
            parts.append(f"{key} {value}")
    return "  ".join(parts)


class Progress:
    """``update(done, **fields)`` reports that ``done`` of ``total`` steps are finished (``start`` were
    finished before this run, e.g. in a resumed checkpoint); ``fields`` are shown after the counter."""

    def __init__(self, total: int, label: str, start: int = 0, mode: str = "auto",
                 stream: Optional[TextIO] = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.total, self.label, self.start = max(1, total), label, start
        self.stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "log"
        self.mode = mode
        self.bar = None
        self.started = time.perf_counter()
        self.next_line_at = start
        if mode == "off":
            return
        self.tqdm = require_tqdm()
        if mode == "bar":
            self.bar = self.tqdm(total=self.total, initial=start, desc=label, unit="step", file=self.stream,
                                 dynamic_ncols=True, leave=True)

    def update(self, done: int, **fields) -> None:
        postfix = format_fields(fields)
        if self.bar is not None:
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(done - self.bar.n)
            if done >= self.total:
                self.close()
        elif self.mode == "log" and (done >= self.next_line_at or done >= self.total):
            line = self.tqdm.format_meter(done, self.total, time.perf_counter() - self.started,
                                          prefix=self.label, ascii=".#", unit="step", postfix=postfix,
                                          initial=self.start, bar_format="{l_bar}{bar:24}{r_bar}")
            self.stream.write(line + "\n")
            self.stream.flush()
            self.next_line_at = done + max(1, self.total // 10)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
