"""The training example's figure, training.png, drawn with matplotlib (the ``examples`` extra).

Panels on one step axis: the loss of every run (each step faint, its moving average bold); with a
baseline, the distance between the hipdlrm and baseline moving averages against the agreement tolerance
(the quantity the example's verdict is about); the throughput. matplotlib is imported when a figure is
drawn, not with hipdlrm, and renders through its Agg canvas: no display, no global pyplot state.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

# Run styles in order (hipdlrm, the baseline, the noise-floor run, then --eager-and-graphed's graphed hipdlrm
# and baseline runs in lighter shades of their eager runs' colours): blue and orange stay apart under the
# common colour-vision deficiencies, and the line styles tell every curve apart in greyscale too.
RUN_STYLES = (("#1f5fa8", "-"), ("#e07b00", "--"), ("#3b9e4a", ":"), ("#74a9e0", "-."), ("#f5b461", (0, (5, 1, 1, 1))))
DIFF_COLOR = "#6a3d9a"
FLOOR_COLOR = "#7f7f7f"
TOLERANCE_COLOR = "#c62828"
# |difference| below this is drawn at this value on the log axis (identical curves differ by exactly 0).
DIFF_FLOOR = 1e-9


def require_matplotlib():
    """matplotlib's Figure class, or an ImportError saying how to get it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "the training example draws training.png with matplotlib, which is not installed: "
            "pip install 'matplotlib' (or the example's extra, pip install 'hipdlrm[examples]'; bash scripts/setup.sh "
            "installs it), or run with --no-plot") from e
    return Figure


@dataclass
class Run:
    """One trained model's curves, step-indexed from 0."""

    label: str
    loss: Sequence[float]               # per step
    loss_smoothed: Sequence[float]      # its trailing moving average
    rate_steps: Sequence[int]           # the steps the throughput is given for (after the warm-up)
    rate: Sequence[float]               # examples/s, a moving average
    style: Optional[int] = None         # index into RUN_STYLES [default: the run's position]


@dataclass
class Difference:
    """|hipdlrm - baseline| of the moving averages per step, and what it is judged against."""

    values: Sequence[float]
    tolerance: float
    agree: bool
    window: int
    floor: Optional[Sequence[float]] = None        # the same distance between the baseline and its reordered run
    effective_tolerance: Optional[float] = None    # max(tolerance, the floor's largest value)


def _positive(values: Sequence[float]) -> List[float]:
    return [max(v, DIFF_FLOOR) if math.isfinite(v) else math.nan for v in values]


def _draw_difference(ax, diff: Difference, baseline_label: str) -> None:
    steps = range(len(diff.values))
    ax.plot(steps, _positive(diff.values), color=DIFF_COLOR, lw=1.8, label=f"hipdlrm vs\n{baseline_label}")
    if diff.floor is not None:
        ax.plot(range(len(diff.floor)), _positive(diff.floor), color=FLOOR_COLOR, lw=1.4, ls=":",
                label=f"noise floor:\n{baseline_label} vs\nitself, bags reversed")
    ax.axhline(diff.tolerance, color=TOLERANCE_COLOR, lw=1.3, ls="--", label=f"tolerance {diff.tolerance:g}")
    if diff.effective_tolerance is not None and diff.effective_tolerance > diff.tolerance:
        ax.axhline(diff.effective_tolerance, color=TOLERANCE_COLOR, lw=1.0, ls="-.", alpha=0.7,
                   label=f"tolerance with the\nnoise floor {diff.effective_tolerance:.2g}")
    worst = max(steps, key=lambda i: diff.values[i] if math.isfinite(diff.values[i]) else -math.inf)
    at = (worst, max(diff.values[worst], DIFF_FLOOR))
    ax.plot(*at, "o", color=DIFF_COLOR, ms=5)
    ax.set_yscale("log")
    top = 8 * max([diff.effective_tolerance or diff.tolerance, *(v for v in diff.values if math.isfinite(v)),
                   *(v for v in (diff.floor or ()) if math.isfinite(v))])
    ax.axhspan(diff.effective_tolerance or diff.tolerance, top, color=TOLERANCE_COLOR, alpha=0.06, lw=0)
    ax.set_ylim(None, top)
    ax.set_ylabel(f"|difference| of the\n{diff.window}-step averages")
    if not diff.agree:
        verdict = "disagree"
    elif diff.effective_tolerance is not None and max(v for v in diff.values if math.isfinite(v)) > diff.tolerance:
        verdict = "agree within the noise floor"
    else:
        verdict = "agree"
    # The largest distance is marked on the curve and named in the title, where no label covers a curve.
    ax.set_title(f"Loss curves {verdict}: distance of the moving averages, at most {diff.values[worst]:.2g} "
                 f"(step {worst}, marked), against the tolerance", loc="left", fontsize=10)


def write_training_plot(path: Path, title: str, runs: Sequence[Run], rate_unit: str,
                        difference: Optional[Difference] = None, footer: str = "") -> Path:
    """Draws the panels into one PNG at ``path`` (runs[0] is hipdlrm, runs[1] the baseline, if any)."""
    Figure = require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    panels = 3 if difference is not None else 2
    ratios = [3.0, 2.0, 2.0][:panels] if difference is not None else [3.0, 2.0]
    fig = Figure(figsize=(11.5, 3.2 + 2.4 * (panels - 1)), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1, sharex=True, gridspec_kw={"height_ratios": ratios})
    loss_ax, rate_ax = axes[0], axes[-1]

    for i, run in enumerate(runs):
        color, ls = RUN_STYLES[(i if run.style is None else run.style) % len(RUN_STYLES)]
        steps = range(len(run.loss))
        loss_ax.plot(steps, run.loss, color=color, lw=0.8, alpha=0.25)
        loss_ax.plot(steps, run.loss_smoothed, color=color, lw=2.0, ls=ls, label=run.label)
        rate_ax.plot(run.rate_steps, run.rate, color=color, lw=1.8, ls=ls, label=run.label)
    window = difference.window if difference is not None else None
    loss_ax.set_ylabel("BCE loss")
    loss_ax.set_title("Training loss: each step (faint) and its moving average" +
                      (f" over {window} steps" if window else ""), loc="left", fontsize=10)

    if difference is not None:
        _draw_difference(axes[1], difference, runs[1].label if len(runs) > 1 else "baseline")

    rate_ax.set_ylabel(rate_unit)
    rate_ax.set_title("Throughput (after the warm-up steps)", loc="left", fontsize=10)
    rate_ax.set_xlabel("step")
    rate_ax.set_ylim(bottom=0)
    rate_ax.yaxis.set_major_formatter(_thousands())

    for ax in axes:
        # Legends beside the panels, where they never cover a curve.
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9, handlelength=2.6)
        ax.grid(True, color="#e3e3e3", lw=0.8)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    loss_ax.set_xlim(0, max(1, max(len(r.loss) for r in runs) - 1))
    fig.suptitle(title, x=0.01, ha="left", fontsize=12.5, fontweight="bold")
    if footer:
        fig.text(0.995, 0.002, footer, ha="right", va="bottom", fontsize=7.5, color="#777777")
    path = Path(path)
    fig.savefig(path)
    return path


def _thousands():
    from matplotlib.ticker import FuncFormatter

    def fmt(value, _pos):
        if abs(value) >= 1e6:
            return f"{value / 1e6:.3g}M"
        if abs(value) >= 1e4:
            return f"{value / 1e3:.3g}k"
        return f"{value:,.0f}"

    return FuncFormatter(fmt)
