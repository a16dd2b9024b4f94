"""Embedding-index bounds check (FBGEMM's `bounds_check_indices` contract).

    torch.ops.hipdlrm.bounds_check_indices(rows_per_table, indices, offsets, bounds_check_mode,
                                           warning, weights=None, B_offsets=None, max_B=-1)

mutates `indices`, `offsets` and `warning` in place (see docs/bounds_check.md).
"""
import atexit
import enum
import operator
from typing import Optional, Union

import torch


class BoundsCheckMode(enum.IntEnum):
    """FBGEMM's codes: FATAL raises, WARNING repairs and reports, IGNORE repairs silently."""

    FATAL = 0
    WARNING = 1
    IGNORE = 2


@torch.library.register_fake("hipdlrm::bounds_check_indices")
def _bounds_check_indices_fake(rows_per_table, indices, offsets, bounds_check_mode, warning, weights=None,
                               B_offsets=None, max_B=-1):
    return None


@torch.library.register_fake("hipdlrm::_bounds_check_indices_impl")
def _bounds_check_indices_impl_fake(rows_per_table, indices, offsets, bounds_check_mode, warning, weights,
                                    B_offsets, max_B, per_thread_atomics):
    return None


def _as_mode(bounds_check_mode) -> BoundsCheckMode:
    """A BoundsCheckMode member, an integer equal to one, or a member's name in any case; nothing else."""
    if isinstance(bounds_check_mode, BoundsCheckMode):
        return bounds_check_mode
    choices = ", ".join(f"{m.name} ({m.value})" for m in BoundsCheckMode)
    if isinstance(bounds_check_mode, str):
        try:
            return BoundsCheckMode[bounds_check_mode.upper()]
        except KeyError:
            pass
    elif not isinstance(bounds_check_mode, bool):  # True would silently mean WARNING
        try:
            return BoundsCheckMode(operator.index(bounds_check_mode))  # ints, numpy ints; not floats
        except (TypeError, ValueError):
            pass
    raise ValueError(
        f"bounds_check_indices: bounds_check_mode must be a BoundsCheckMode, its value or its name: {choices}; "
        f"got {bounds_check_mode!r}"
    )


def bounds_check_indices(
    rows_per_table: torch.Tensor,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    bounds_check_mode: Union[BoundsCheckMode, int, str] = BoundsCheckMode.WARNING,
    warning: Optional[torch.Tensor] = None,
    weights: Optional[torch.Tensor] = None,
    B_offsets: Optional[torch.Tensor] = None,
    max_B: int = -1,
) -> torch.Tensor:
    """Checks (and, unless FATAL, repairs) `indices` and `offsets` in place; returns `warning`.

    `warning` (a one-element int64 tensor, allocated on indices' device when not given) receives, in
    WARNING mode, the number of problems found: out-of-range indices, repaired bags, a wrong last offset.
    `bounds_check_mode` is a BoundsCheckMode, its int value or its name (any case, e.g. "warning").
    """
    mode = _as_mode(bounds_check_mode)
    if warning is None:
        warning = torch.zeros(1, dtype=torch.int64, device=indices.device)
    torch.ops.hipdlrm.bounds_check_indices(
        rows_per_table, indices, offsets, int(mode), warning, weights, B_offsets, max_B
    )
    return warning


def flush_bounds_check_warnings() -> None:
    """Prints the WARNING lines of GPU calls still pending, waiting for those calls to finish.

    On the GPU, WARNING mode does not stall the stream to print: a call's line is printed by the next
    call, by this function, or at interpreter exit. On the CPU lines are printed at once.
    Set HIPDLRM_QUIET_WARNINGS=1 to silence the lines (the `warning` counter is still written).
    """
    torch.ops.hipdlrm._flush_bounds_check_warnings()


atexit.register(flush_bounds_check_warnings)
