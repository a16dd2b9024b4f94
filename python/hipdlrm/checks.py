"""Errors found on the GPU without stalling it: hipdlrm.synchronize() and the strict mode.

A GPU op never reads tensor values on the host (that would stall the CPU until the GPU catches up, and
could not be captured in a CUDA graph). Its kernels judge the values instead: they stay memory-safe for
any values, and the first invalid one they meet (an out-of-range index in grouped index select, bad
offsets or lengths in attention, a FATAL bounds-check violation) is recorded on the device. The next
hipdlrm call on that device raises it as a RuntimeError naming the op, the argument, the position and
the value, once the GPU has run the failing kernels; ``synchronize()`` waits for them and raises at
once. docs/errors.md says what each op did with the invalid values.
"""
import torch

__all__ = ["synchronize", "set_strict_checks", "strict_checks"]


def synchronize() -> None:
    """Waits for every device hipdlrm has run on, prints pending bounds-check WARNING lines and raises
    the first invalid value a GPU kernel has recorded since the last raise (a no-op on the CPU)."""
    torch.ops.hipdlrm._synchronize()


def set_strict_checks(enabled: bool) -> None:
    """Strict mode on or off: with it, every GPU call waits for its own kernels and raises what they
    found before it returns, so the error points at the failing call (one host sync per call: for
    debugging, not training). Calls being captured in a CUDA graph do not wait. Also set at import by
    the environment variable ``HIPDLRM_STRICT_CHECKS`` (any value but "0")."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_strict_checks: enabled must be a bool, got {type(enabled).__name__}")
    torch.ops.hipdlrm._set_strict_checks(enabled)


def strict_checks() -> bool:
    """Whether strict mode is on (set_strict_checks, HIPDLRM_STRICT_CHECKS)."""
    return bool(torch.ops.hipdlrm._strict_checks())


@torch.library.register_fake("hipdlrm::_check_blocks")
def _check_blocks_fake(starts, sizes, limit, op, argument):
    """_check_blocks returns nothing: traced, it is only its side effect (the check)."""
    return None
