"""HSTU attention (generative-recommenders' ``hstu_mha`` contract), differentiable in q, k, v and rab.

    torch.ops.hipdlrm.hstu_mha_fwd(max_seq_len, alpha, q, k, v, seq_offsets, causal, num_targets,
                                   attn_scale, attn_scale_per_token, max_attn_len, contextual_seq_len,
                                   rab, min_full_attn_seq_len=0, dropout_pr=0.0, dropout_seed=None) -> Tensor
    torch.ops.hipdlrm.hstu_mha_bwd(max_seq_len, alpha, grad_out, q, k, v, seq_offsets, causal,
                                   num_targets, attn_scale, attn_scale_per_token, max_attn_len,
                                   contextual_seq_len, rab, rab_requires_grad, min_full_attn_seq_len=0,
                                   dropout_pr=0.0, dropout_seed=None)
        -> (grad_q, grad_k, grad_v, grad_rab or None)

Registered here: the fake (meta) kernels used by torch.compile; the autograd formula of the forward op,
which makes ``hstu_mha_fwd`` itself differentiable, is registered in C++. See docs/attention.md for the contract and the mask.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Optional, Union

import torch

_FORWARD = "hipdlrm::hstu_mha_fwd"
_BACKWARD = "hipdlrm::hstu_mha_bwd"



# ---- scalar arguments of the attention wrappers (hstu_mha, gdpa) -------------------------------------------
# Each raises, before anything is computed or allocated, a TypeError or ValueError that names the function,
# the argument, what it expects and what it got. bool is rejected where a number is wanted (True would
# silently count as 1), and anything but a bool where a flag is wanted (bool("no") is True).

def _is_bool(value: Any) -> bool:
    """A Python bool, a bool tensor or a numpy bool."""
    if isinstance(value, bool):
        return True
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.bool
    return str(getattr(value, "dtype", "")) == "bool"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"


def _int_arg(fn: str, name: str, value: Any, optional: bool = False) -> Optional[int]:
    if type(value) is int:  # the common case first: these checks run on every call
        return value
    if value is None and optional:
        return None
    if not _is_bool(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
    expected = "an int or None" if optional else "an int"
    raise TypeError(f"{fn}: {name} must be {expected}, got {_describe(value)}")


def _float_arg(fn: str, name: str, value: Any) -> float:
    if type(value) is float and math.isfinite(value):
        return value
    is_number = isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.dim() == 0
                                                   and not value.is_complex())
    if value is None or _is_bool(value) or not is_number:
        raise TypeError(f"{fn}: {name} must be a float, got {_describe(value)}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{fn}: {name} must be finite, got {result}")
    return result


def _bool_arg(fn: str, name: str, value: Any) -> bool:
    if value is True or value is False:
        return value
    if not _is_bool(value) or (isinstance(value, torch.Tensor) and value.dim() != 0):
        raise TypeError(f"{fn}: {name} must be a bool, got {_describe(value)}")
    return bool(value)



@torch.library.register_fake(_FORWARD)
def _forward_fake(max_seq_len, alpha, q, k, v, seq_offsets, causal, num_targets, attn_scale,
                  attn_scale_per_token, max_attn_len, contextual_seq_len, rab, min_full_attn_seq_len=0,
                  dropout_pr=0.0, dropout_seed=None):
    torch._check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, lambda: "q, k and v must be 3-D")
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@torch.library.register_fake(_BACKWARD)
def _backward_fake(max_seq_len, alpha, grad_out, q, k, v, seq_offsets, causal, num_targets, attn_scale,
                   attn_scale_per_token, max_attn_len, contextual_seq_len, rab, rab_requires_grad,
                   min_full_attn_seq_len=0, dropout_pr=0.0, dropout_seed=None):
    torch._check(not rab_requires_grad or rab is not None, lambda: "rab_requires_grad is true but rab is None")
    grad_rab = rab.new_empty(rab.shape) if rab_requires_grad else None
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), grad_rab


# The autograd formula is registered in C++ (csrc/ops/attention/attention_autograd.cpp): a Python autograd
# kernel sat on every call's critical path.


def hstu_mha(
    max_seq_len: int,
    alpha: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    causal: bool = True,
    num_targets: Optional[torch.Tensor] = None,
    attn_scale: Union[float, torch.Tensor, None] = None,
    max_attn_len: int = 0,
    contextual_seq_len: int = 0,
    rab: Optional[torch.Tensor] = None,
    *,
    min_full_attn_seq_len: int = 0,
    dropout_pr: float = 0.0,
    training: bool = True,
    sort_by_length: bool = False,
    kernel: Any = None,
) -> torch.Tensor:
    """HSTU attention over a jagged batch; returns ``[L, H, Dv]`` in q's dtype.

    For each sequence b (tokens ``seq_offsets[b]:seq_offsets[b+1]``, length n <= max_seq_len) and head:
    ``O = (SiLU(alpha * q k^T + rab[b, h, :n, :n]) * scale (.) valid) v`` with ``scale = 1 / max_seq_len``,
    or ``attn_scale`` (a float, or a tensor with one value per token scaling its row; a 0-d tensor
    scales every row), and the valid mask of docs/attention.md (causal, num_targets, max_attn_len,
    contextual_seq_len).

    Args:
        q, k: ``[L, H, Dqk]``; v: ``[L, H, Dv]``; one dtype (float16, bfloat16, float32; float64 for
            gradcheck), any head dims (the GPU kernels serve 16, 32, 64, 128 and 256 in fp16/bf16; others take
            the composite path, which on a GPU pads the sequences to max_seq_len: correct, not fast).
        seq_offsets: ``[B + 1]`` int32 or int64, non-decreasing, from 0 to L.
        num_targets: optional ``[B]`` int32/int64, the number of target tokens at the end of each sequence.
        rab: optional relative attention bias ``[1 or B, 1 or H, max_seq_len, max_seq_len]`` in q's dtype,
            added after alpha scales q k^T (not scaled by alpha).

    generative-recommenders' keywords (so that its model code runs on hipdlrm by import):
        min_full_attn_seq_len: with ``max_attn_len > 0``, the last ``min_full_attn_seq_len`` positions before
            the targets (and the targets) attend without the distance limit, as GR's mask defines it.
        dropout_pr, training: attention dropout, GR's ``F.dropout(p=dropout_pr, training=training)`` on the
            masked attention weights (each weight zeroed with probability dropout_pr, the kept ones scaled by
            ``1 / (1 - dropout_pr)``). The mask comes from a seed drawn from torch's generator of q's device
            (``torch.manual_seed`` makes a run reproducible; nothing is read on the host, so the call stays
            graph-capturable) through a counter-based hash of (seed, sequence, head, position, position), so
            the backward recomputes it instead of storing it (docs/attention.md, "Dropout"). On a GPU, fp16
            and bf16 inputs run it inside the portable attention kernels (on Hopper too, where the wgmma
            kernels have none); fp32 and other head dims on the composite path.
        sort_by_length: GR's kernels schedule the sequences longest first with it; hipdlrm's GPU kernels
            always do (their tile schedule), and the result is the same either way: it changes nothing here.
        kernel: GR's backend choice (its Kernel enum); ignored: hipdlrm runs its own kernels.

    Differentiable in q, k, v and rab; attn_scale is a constant. The scalar arguments are checked before
    anything runs: ``max_seq_len``, ``max_attn_len`` and ``contextual_seq_len`` must be ints (not bools),
    ``alpha`` a finite float (required, as in generative-recommenders), ``causal`` a bool.
    """
    fn = "hstu_mha"
    max_seq_len = _int_arg(fn, "max_seq_len", max_seq_len)
    alpha = _float_arg(fn, "alpha", alpha)
    causal = _bool_arg(fn, "causal", causal)
    max_attn_len = _int_arg(fn, "max_attn_len", max_attn_len)
    contextual_seq_len = _int_arg(fn, "contextual_seq_len", contextual_seq_len)
    min_full_attn_seq_len = _int_arg(fn, "min_full_attn_seq_len", min_full_attn_seq_len)
    dropout_pr = _float_arg(fn, "dropout_pr", dropout_pr)
    training = _bool_arg(fn, "training", training)
    _bool_arg(fn, "sort_by_length", sort_by_length)
    if not 0.0 <= dropout_pr < 1.0:
        raise ValueError(f"{fn}: dropout_pr must be in [0, 1), got {dropout_pr}")
    dropout_seed: Optional[torch.Tensor] = None
    if not training:
        dropout_pr = 0.0
    elif dropout_pr > 0.0:
        dropout_seed = torch.randint(-2**63, 2**63 - 1, (1,), dtype=torch.int64, device=q.device)
    scale_value: Optional[float] = None
    scale_per_token: Optional[torch.Tensor] = None
    if isinstance(attn_scale, torch.Tensor):
        scale_per_token = attn_scale.expand(q.shape[0]) if attn_scale.dim() == 0 else attn_scale
    elif attn_scale is not None:
        scale_value = _float_arg(fn, "attn_scale", attn_scale)
    return torch.ops.hipdlrm.hstu_mha_fwd(max_seq_len, alpha, q, k, v, seq_offsets, causal, num_targets, scale_value,
                                          scale_per_token, max_attn_len, contextual_seq_len, rab,
                                          min_full_attn_seq_len, dropout_pr, dropout_seed)
