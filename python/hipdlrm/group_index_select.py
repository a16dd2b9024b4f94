"""Grouped index select along dim 0 (FBGEMM's ``group_index_select_dim0`` contract), differentiable.

    torch.ops.hipdlrm.group_index_select_dim0(input_group, indices_group) -> List[Tensor]

returns ``[input.index_select(0, indices) for input, indices in zip(input_group, indices_group)]`` in
one kernel launch for the whole group (and one for the backward). Registered here: the fake (meta)
kernels used by torch.compile; the autograd formulas, which make the op itself differentiable, are
registered in C++. See docs/group_index_select.md.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

_FORWARD = "hipdlrm::group_index_select_dim0"
_IMPL = "hipdlrm::_group_index_select_dim0_impl"
_BACKWARD = "hipdlrm::_group_index_select_dim0_backward"
DEFAULT_CACHE_SLOTS = 2


def _gathered_like(input_group, indices_group) -> List[torch.Tensor]:
    torch._check(
        len(input_group) == len(indices_group),
        lambda: f"input_group has {len(input_group)} tensors but indices_group has {len(indices_group)}",
    )
    return [inp.new_empty((idx.shape[0],) + tuple(inp.shape[1:])) for inp, idx in zip(input_group, indices_group)]


@torch.library.register_fake(_FORWARD)
def _forward_fake(input_group, indices_group):
    return _gathered_like(input_group, indices_group)


@torch.library.register_fake(_IMPL)
def _impl_fake(input_group, indices_group, group_width=0, cache_slots=DEFAULT_CACHE_SLOTS, deterministic=None):
    return _gathered_like(input_group, indices_group)


@torch.library.register_fake(_BACKWARD)
def _backward_fake(grad_output_group, indices_group, input_rows, cache_slots=DEFAULT_CACHE_SLOTS,
                   deterministic=False, check_indices=True):
    torch._check(
        len(grad_output_group) == len(indices_group) == len(input_rows),
        lambda: "grad_output_group, indices_group and input_rows must have one entry per group member",
    )
    return [g.new_empty((rows,) + tuple(g.shape[1:])) for g, rows in zip(grad_output_group, input_rows)]


# The autograd formulas are registered in C++ (csrc/ops/group_index_select/group_index_select_autograd.cpp):
# a Python autograd kernel sat on every call's critical path.


def group_index_select(
    inputs: Sequence[torch.Tensor],
    indices: Sequence[torch.Tensor],
    *,
    deterministic: Optional[bool] = None,
) -> List[torch.Tensor]:
    """``[x.index_select(0, i) for x, i in zip(inputs, indices)]`` for the whole group at once.

    Inputs may differ in row count and row width (trailing dims are flattened) but share one dtype
    (float32, float16, bfloat16 or float64) and one device; each index tensor is 1-D int32 or int64 and
    may have its own length. An index outside ``[0, rows)`` raises a RuntimeError naming the member,
    position and value.

    The gradient is scatter-added into zero-initialised gradients of the inputs. ``deterministic``
    selects how on a GPU: True sorts and segment-reduces without atomics (bit-identical run to run),
    False uses atomics merged in a per-thread register cache, and None (the default) follows
    ``torch.are_deterministic_algorithms_enabled()`` when the backward runs. An empty group returns [].
    """
    inputs, indices = list(inputs), list(indices)
    if len(inputs) != len(indices):
        raise ValueError(f"group_index_select: {len(inputs)} inputs but {len(indices)} index tensors")
    if not inputs:
        return []
    if deterministic is None:
        return torch.ops.hipdlrm.group_index_select_dim0(inputs, indices)
    return torch.ops.hipdlrm._group_index_select_dim0_impl(inputs, indices, 0, DEFAULT_CACHE_SLOTS,
                                                           bool(deterministic))
