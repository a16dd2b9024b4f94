"""GDPA attention (Meta's generalized dot-product attention), differentiable in query, key and value.

    torch.ops.hipdlrm.gdpa_fwd(query, key, value, query_offset, key_offset, max_seq_len_q, max_seq_len_kv,
                               activation="gelu", qk_scale=1.0, window_size=None, broadcast_q=False) -> Tensor
    torch.ops.hipdlrm.gdpa_bwd(grad_out, query, key, value, query_offset, key_offset, max_seq_len_q,
                               max_seq_len_kv, activation, qk_scale, window_size, broadcast_q)
        -> (grad_query, grad_key, grad_value)

Registered here: the fake (meta) kernels used by torch.compile; the autograd formula of the forward op,
which makes ``gdpa_fwd`` itself differentiable, is registered in C++. See docs/attention.md (GDPA) for the contract.
"""
from __future__ import annotations

from typing import Optional

import torch

from .attention import _bool_arg, _float_arg, _int_arg

_FORWARD = "hipdlrm::gdpa_fwd"
_BACKWARD = "hipdlrm::gdpa_bwd"

#: The activations ``gdpa`` accepts, by name.
GDPA_ACTIVATIONS = ("raw", "relu", "gelu", "fast_gelu", "silu")



def _output_rows(query: torch.Tensor, key_offset: torch.Tensor, broadcast_q: bool):
    """Rows of the output: B * Lq with broadcast_q (B = key_offset.shape[0] - 1), else Lq."""
    return (key_offset.shape[0] - 1) * query.shape[0] if broadcast_q else query.shape[0]


@torch.library.register_fake(_FORWARD)
def _forward_fake(query, key, value, query_offset, key_offset, max_seq_len_q, max_seq_len_kv, activation="gelu",
                  qk_scale=1.0, window_size=None, broadcast_q=False):
    torch._check(query.dim() == 3 and key.dim() == 3 and value.dim() == 3,
                 lambda: "query, key and value must be 3-D")
    return query.new_empty((_output_rows(query, key_offset, broadcast_q), query.shape[1], query.shape[2]))


@torch.library.register_fake(_BACKWARD)
def _backward_fake(grad_out, query, key, value, query_offset, key_offset, max_seq_len_q, max_seq_len_kv,
                   activation, qk_scale, window_size, broadcast_q):
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape)


# The autograd formula is registered in C++ (csrc/ops/attention/attention_autograd.cpp).


def gdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_offset: torch.Tensor,
    key_offset: torch.Tensor,
    max_seq_len_q: int,
    max_seq_len_kv: int,
    activation: str = "gelu",
    qk_scale: Optional[float] = 1.0,
    window_size: Optional[int] = None,
    broadcast_q: bool = False,
) -> torch.Tensor:
    """GDPA over a jagged batch; returns ``[Lq, Hq, D]`` (``[B * Lq, Hq, D]`` with broadcast_q) in query's dtype.

    For each sample b (query rows ``query_offset[b]:query_offset[b+1]``, key/value rows
    ``key_offset[b]:key_offset[b+1]``) and query head h (reading kv head ``h // (Hq // Hkv)``), with i and
    j positions within the sample's query and key sequences::

        S = q_b k_b^T                     (no pre-scale)
        S[i, j] = 0 where |i - j| > window_size   (when window_size is given)
        P = act(S) * qk_scale            (scale after the activation)
        O_b = P v_b

    No softmax, no normalisation, no causal mask; rows of samples without keys are zeros.

    Args:
        query: ``[Lq, Hq, D]``; key, value: ``[Lkv, Hkv, D]``, Hq a multiple of Hkv; any D (the GPU kernels
            serve 16, 32, 64, 128 and 256 in fp16/bf16; others take the composite path, which on a GPU pads the
            samples to max_seq_len_q and max_seq_len_kv: correct, not fast); one
            dtype (float16, bfloat16, float32; float64 for gradcheck) and one device for every tensor.
        query_offset, key_offset: ``[B + 1]`` int32 or int64, from 0, non-decreasing, ending at Lq and Lkv;
            every query length <= max_seq_len_q and every key length <= max_seq_len_kv.
        activation: one of ``GDPA_ACTIVATIONS``: "raw" (identity), "relu", "gelu" (erf form),
            "fast_gelu" (tanh form), "silu".
        qk_scale: multiplies act(S); None means 1.0, as in Meta's GDPA.
        window_size: ``w >= 0`` keeps only pairs with ``|i - j| <= w``; None keeps every pair.
        broadcast_q: query holds one sequence shared by every sample (``query_offset = [0, Lq]``); sample b's
            output rows are ``b * Lq .. (b + 1) * Lq - 1`` and the query gradient sums over samples.

    Differentiable in query, key and value. The scalar arguments are checked before anything runs:
    ``max_seq_len_q``, ``max_seq_len_kv`` and ``window_size`` must be ints (not bools), ``activation`` a str,
    ``qk_scale`` a finite float or None, ``broadcast_q`` a bool.
    """
    fn = "gdpa"
    max_seq_len_q = _int_arg(fn, "max_seq_len_q", max_seq_len_q)
    max_seq_len_kv = _int_arg(fn, "max_seq_len_kv", max_seq_len_kv)
    if not isinstance(activation, str):
        raise TypeError(f"{fn}: activation must be a str, one of {GDPA_ACTIVATIONS}, got "
                        f"{type(activation).__name__} {activation!r}")
    qk_scale = 1.0 if qk_scale is None else _float_arg(fn, "qk_scale", qk_scale)
    window_size = _int_arg(fn, "window_size", window_size, optional=True)
    broadcast_q = _bool_arg(fn, "broadcast_q", broadcast_q)
    return torch.ops.hipdlrm.gdpa_fwd(query, key, value, query_offset, key_offset, max_seq_len_q, max_seq_len_kv,
                                      activation, qk_scale, window_size, broadcast_q)
