"""Table Batched Embedding: many embedding tables looked up in one launch, trained by a backward with the
optimizer fused in (docs/tbe.md).

FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` contract for tables resident on the device:
``TableBatchedEmbedding`` keeps every table in one flat weights buffer and runs, per forward call,
``bounds_check_indices`` in the module's mode and then the registered op

    torch.ops.hipdlrm.tbe_forward(weights, weights_offsets, D_offsets, rows_per_table, total_D, max_D,
                                  indices, offsets, pooling_mode, per_sample_weights, output_dtype,
                                  vbe_batch_sizes=None, vbe_output_size=-1) -> Tensor

Layout (FBGEMM's, table-major): T features, B bags each; bag b of feature t holds
``indices[offsets[t*B + b] : offsets[t*B + b + 1]]``. Pooled modes return ``[B, total_D]`` with feature
t in columns ``D_offsets[t] : D_offsets[t + 1]``; NONE returns ``[len(indices), D]``. VBE (variable batch
sizes, FBGEMM's ``batch_size_per_feature_per_rank``): ``vbe_batch_sizes`` is ``[T, R]`` int64 on the tables'
device, ``offsets`` then holds ``vbe_batch_sizes.sum()`` bags feature-major (feature, rank, bag) and the
pooled output is FBGEMM's 1-D layout of ``vbe_output_size`` values, rank-major (rank, feature, bag); the
backward ops take the same batch sizes.

Training: with a fused optimizer, ``loss.backward()`` calls

    torch.ops.hipdlrm.tbe_backward(grad_output, weights, weights_offsets, D_offsets, rows_per_table,
        row_offsets, total_rows, total_D, max_D, indices, offsets, pooling_mode, per_sample_weights,
        optimizer, momentum1, momentum2, learning_rate, eps, beta1, beta2, weight_decay,
        weight_decay_mode, stochastic_rounding, optimizer_counters, eta, momentum, max_norm)
        -> grad_per_sample_weights

which updates ``weights`` and the states ``momentum1`` / ``momentum2`` in place and adds one to the step in
``optimizer_counters`` = [step, seed] (on the device: no host-side counter, so a compiled or captured
training step has no synchronisation); with ``OptimType.NONE``

    torch.ops.hipdlrm.tbe_backward_sparse(grad_output, weights, ..., per_sample_weights)
        -> (element_indices, values, grad_per_sample_weights)

gives ``weights.grad`` a sparse COO gradient for an external optimizer. The module builds these argument
lists in one place each (``_lookup_metadata``, ``_optimizer_arguments``). With ``gradient_clipping`` the
module clamps ``grad_output`` to ``[-max_gradient, max_gradient]`` before either op (FBGEMM's clipping).
"""
from __future__ import annotations

import enum
import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .bounds_check import BoundsCheckMode

__all__ = ["OptimType", "PoolingMode", "TableBatchedEmbedding", "WeightDecayMode"]


# The codes are the ops' arguments; kernels/tbe/tbe_types.h defines the same ones (a test compares them
# with torch.ops.hipdlrm.tbe_enum).


class PoolingMode(enum.IntEnum):
    """FBGEMM's codes. SUM and MEAN pool each bag into one row (MEAN of an empty bag is 0); NONE
    returns one row per index (sequence embeddings)."""

    SUM = 0
    MEAN = 1
    NONE = 2


class OptimType(enum.IntEnum):
    """The optimizer fused into the backward (the codes are the op's ``optimizer`` argument).

    NONE: no update; ``weights.grad`` receives a sparse COO gradient. EXACT_SGD: ``w -= lr * g``.
    EXACT_ROWWISE_ADAGRAD: one fp32 state per row, ``s += mean(g^2)``, ``w -= lr * g / (sqrt(s) + eps)``.
    ADAM: two fp32 states per element, bias-corrected with the module's step counter. EXACT_ADAGRAD: one
    fp32 state per element, ``s += g^2``, ``w -= lr * g / (sqrt(s) + eps)`` (torch.optim.Adagrad's step).
    PARTIAL_ROWWISE_ADAM: Adam with its first moment per element and its second moment per row (of the row's
    ``mean(g^2)``), as FBGEMM's. LARS_SGD (FBGEMM's): momentum SGD at a per-row learning rate
    ``lr * eta * |w| / (|g| + wd * |w|)``, one fp32 momentum per element. LAMB (FBGEMM's): Adam's direction
    (two fp32 states per element) scaled per row by the trust ratio ``|w| / |direction|``.
    PARTIAL_ROWWISE_LAMB (FBGEMM's): LAMB with partial row-wise Adam's moments (the first per element, the
    second per row of the row's ``mean(g^2)``). "Exact": only rows looked up in the batch are updated, each
    once with the sum of its gradients.
    """

    NONE = 0
    EXACT_SGD = 1
    EXACT_ROWWISE_ADAGRAD = 2
    ADAM = 3
    EXACT_ADAGRAD = 4
    PARTIAL_ROWWISE_ADAM = 5
    LARS_SGD = 6
    LAMB = 7
    PARTIAL_ROWWISE_LAMB = 8


class WeightDecayMode(enum.IntEnum):
    """FBGEMM's codes. L2 adds ``weight_decay * w`` to the gradient; DECOUPLED subtracts
    ``lr * weight_decay * w`` from the weight after the update (AdamW's form)."""

    NONE = 0
    L2 = 1
    DECOUPLED = 2


_FLOAT_FORMATS = (torch.float32, torch.float16, torch.bfloat16)
# Every table starts on a 128-byte boundary of the flat buffer, so rows whose size is a multiple of 16
# bytes always take the kernels' 16-byte vector path (FBGEMM packs tables back to back instead).
_TABLE_ALIGN_BYTES = 128
_FUSED = (OptimType.EXACT_SGD, OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM, OptimType.EXACT_ADAGRAD,
          OptimType.PARTIAL_ROWWISE_ADAM, OptimType.LARS_SGD, OptimType.LAMB, OptimType.PARTIAL_ROWWISE_LAMB)
# The optimizers with Adam's moments: betas in [0, 1), eps > 0, bias corrections from the step counter.
_ADAMS = (OptimType.ADAM, OptimType.PARTIAL_ROWWISE_ADAM, OptimType.LAMB, OptimType.PARTIAL_ROWWISE_LAMB)
# The optimizers with one state per element (momentum1) and one per row (momentum2).
_PARTIAL_ROWWISE = (OptimType.PARTIAL_ROWWISE_ADAM, OptimType.PARTIAL_ROWWISE_LAMB)


# ---- fake kernels (torch.compile, meta tensors) --------------------------------------------------------

@torch.library.register_fake("hipdlrm::tbe_forward")
def _tbe_forward_fake(weights, weights_offsets, D_offsets, rows_per_table, total_D, max_D, indices, offsets,
                      pooling_mode, per_sample_weights, output_dtype, vbe_batch_sizes=None, vbe_output_size=-1):
    num_features = weights_offsets.numel()
    torch._check(num_features >= 1, lambda: "tbe_forward: there must be at least one feature")
    if vbe_batch_sizes is not None:
        torch._check(vbe_output_size >= 0, lambda: "tbe_forward: vbe_output_size must be >= 0 with vbe_batch_sizes")
        return weights.new_empty((vbe_output_size,), dtype=output_dtype)
    if pooling_mode == PoolingMode.NONE:
        return weights.new_empty((indices.numel(), max_D), dtype=output_dtype)
    torch._check((offsets.numel() - 1) % num_features == 0,
                 lambda: "tbe_forward: offsets must have T * B + 1 entries")
    return weights.new_empty(((offsets.numel() - 1) // num_features, total_D), dtype=output_dtype)


def _grad_psw_fake(weights, indices, per_sample_weights):
    n = indices.numel() if per_sample_weights is not None else 0
    return weights.new_empty((n,), dtype=torch.float32)


# The backward ops share their first 13 arguments (the lookup); only the three the outputs depend on are
# named here.
@torch.library.register_fake("hipdlrm::tbe_backward")
def _tbe_backward_fake(grad_output, weights, *args):
    return _grad_psw_fake(weights, args[7], args[10])


@torch.library.register_fake("hipdlrm::tbe_backward_sparse")
def _tbe_backward_sparse_fake(grad_output, weights, *args):
    # One row of max_D entries per lookup, padding included (docs/tbe.md): no size depends on a value.
    nnz = args[7].numel() * args[6] if weights.numel() > 0 else 0
    return (weights.new_empty((nnz,), dtype=torch.int64), weights.new_empty((nnz,)),
            _grad_psw_fake(weights, args[7], args[10]))


# ---- autograd ------------------------------------------------------------------------------------------
# Both ways of differentiating a lookup end in tbe_backward_sparse (or, for the module's fused optimizer, in
# tbe_backward): the raw op's registered autograd, for torch.ops.hipdlrm.tbe_forward called directly, and
# the module's TBELookupFunction, whose backward may update the tables instead of returning a gradient.


def _tbe_forward_setup_context(ctx, inputs, output):
    (weights, weights_offsets, D_offsets, rows_per_table, total_D, max_D, indices, offsets, pooling_mode,
     per_sample_weights, output_dtype, vbe_batch_sizes, vbe_output_size) = inputs
    ctx.save_for_backward(weights, weights_offsets, D_offsets, rows_per_table, indices, offsets, per_sample_weights,
                          vbe_batch_sizes)
    ctx.total_D, ctx.max_D, ctx.pooling_mode = total_D, max_D, pooling_mode


def _tbe_forward_backward(ctx, grad_output):
    """The dense gradient of the flat weights (what an autograd op returns for a dense input) and that of
    the per-sample weights. Each feature gets a row space of its own, row_offsets[t] = t * weights.numel()
    (a table of D >= 1 columns has at most weights.numel() rows): features that share a table, or tables
    that overlap in `weights`, then give separate segments for the same elements, which the scatter adds.
    So any metadata gives the gradient of what the forward computed, with no host read (traceable)."""
    (weights, weights_offsets, D_offsets, rows_per_table, indices, offsets, per_sample_weights,
     vbe_batch_sizes) = ctx.saved_tensors
    T, numel = weights_offsets.numel(), weights.numel()
    row_offsets = torch.arange(T, dtype=torch.int64, device=weights.device) * numel
    element, values, grad_psw = torch.ops.hipdlrm.tbe_backward_sparse(
        grad_output.contiguous(), weights.detach(), weights_offsets, D_offsets, rows_per_table, row_offsets,
        T * numel, ctx.total_D, ctx.max_D, indices, offsets, ctx.pooling_mode, per_sample_weights, vbe_batch_sizes)
    grad_weights = None
    if ctx.needs_input_grad[0]:
        grad_weights = torch.zeros(numel, dtype=values.dtype, device=values.device)
        grad_weights = grad_weights.index_put((element,), values, accumulate=True).view(weights.shape)
        grad_weights = grad_weights.to(weights.dtype)
    if per_sample_weights is None or not ctx.needs_input_grad[9]:
        grad_psw = None
    else:
        grad_psw = grad_psw.to(per_sample_weights.dtype)
    return grad_weights, None, None, None, None, None, None, None, None, grad_psw, None, None, None


torch.library.register_autograd("hipdlrm::tbe_forward", _tbe_forward_backward,
                                setup_context=_tbe_forward_setup_context)


_PLACEHOLDER = "placeholder_autograd_tensor"


class TBELookupFunction(torch.autograd.Function):
    """The module's lookup as an autograd node: forward = ``tbe_forward``; backward = the fused update
    (no gradient for the weights, which do not require one; the empty placeholder gets an empty one) or,
    for OptimType.NONE, the sparse gradient. The per-sample weights get their gradient whenever they
    require it. ``vbe``: (batch sizes, output size) of a VBE lookup (tbe_forward's vbe_batch_sizes and
    vbe_output_size), or None."""

    @staticmethod
    def forward(ctx, module, indices, offsets, weights, per_sample_weights, placeholder, vbe=None):
        ctx.module = module
        ctx.save_for_backward(indices, offsets, per_sample_weights, None if vbe is None else vbe[0])
        return module._forward_op(weights, indices, offsets, per_sample_weights, vbe)

    @staticmethod
    def backward(ctx, grad_output):
        module = ctx.module
        indices, offsets, per_sample_weights, batch_sizes = ctx.saved_tensors
        if module.gradient_clipping:
            # FBGEMM's clipping: each element of the output's gradient, before the backward (so the per-sample
            # weights' gradient is the clipped one's too).
            grad_output = grad_output.clamp(-module.max_gradient, module.max_gradient)
        grad_output = grad_output.contiguous()
        lookup = (indices, offsets, int(module.pooling_mode), per_sample_weights)
        grad_weights = None
        if module.optimizer in _FUSED and ctx.needs_input_grad[5]:
            grad_psw = torch.ops.hipdlrm.tbe_backward(grad_output, module.weights.detach(), *module._lookup_metadata(),
                                                      *lookup, *module._optimizer_arguments(),
                                                      vbe_batch_sizes=batch_sizes)
        else:
            element, values, grad_psw = torch.ops.hipdlrm.tbe_backward_sparse(
                grad_output, module.weights.detach(), *module._lookup_metadata(), *lookup, vbe_batch_sizes=batch_sizes)
            if ctx.needs_input_grad[3]:
                grad_weights = module._sparse_gradient(element, values)
        if not ctx.needs_input_grad[4]:
            grad_psw = None
        # DDP expects every parameter that requires grad to get one each step.
        grad_placeholder = grad_output.new_zeros(0, dtype=torch.float32) if ctx.needs_input_grad[5] else None
        return None, None, None, grad_weights, grad_psw, grad_placeholder, None


# ---- TorchScript: the lookup as an op ------------------------------------------------------------------
# TorchScript compiles no autograd.Function (and TBELookupFunction takes the module itself), so a scripted
# module's forward calls this op instead: tbe_forward, taking the module's tensors and settings as
# arguments, with an autograd registered in Python (TorchScript calls ops through the dispatcher, so it
# runs) whose backward is TBELookupFunction.backward's: the same backward op with the same arguments. Eager
# and torch.compile'd modules keep TBELookupFunction. The fused update mutates weights, momentum1,
# momentum2 and optimizer_counters in the backward only, as tbe_backward declares; the forward mutates
# nothing. `weights` is the module's _lookup_weights(): the flat tables, or a [rows, dim] view of them
# (hipdlrm.fbgemm's weights_dev), which fixes the layout of OptimType.NONE's sparse gradient.
# `optimizer` -1: an inference-only module (no update; the per-sample weights still get their gradient).

_LOOKUP_OP = "hipdlrm::tbe_lookup"
_LOOKUP_SCHEMA = (
    "(Tensor weights, Tensor placeholder, Tensor weights_offsets, Tensor D_offsets, Tensor rows_per_table, "
    "Tensor row_offsets, int total_rows, int total_D, int max_D, Tensor indices, Tensor offsets, int pooling_mode, "
    "Tensor? per_sample_weights, ScalarType output_dtype, int optimizer, Tensor momentum1, Tensor momentum2, "
    "float learning_rate, float eps, float beta1, float beta2, float weight_decay, int weight_decay_mode, "
    "bool stochastic_rounding, Tensor optimizer_counters, float eta, float momentum, float max_norm, "
    "bool gradient_clipping, float max_gradient) -> Tensor")
# Positions in the schema of the inputs that get a gradient.
_LOOKUP_PLACEHOLDER, _LOOKUP_PSW = 1, 12


def _tbe_lookup_impl(weights, placeholder, weights_offsets, D_offsets, rows_per_table, row_offsets, total_rows,
                     total_D, max_D, indices, offsets, pooling_mode, per_sample_weights, output_dtype, optimizer,
                     momentum1, momentum2, learning_rate, eps, beta1, beta2, weight_decay, weight_decay_mode,
                     stochastic_rounding, optimizer_counters, eta, momentum, max_norm, gradient_clipping,
                     max_gradient):
    return torch.ops.hipdlrm.tbe_forward(weights.reshape(-1), weights_offsets, D_offsets, rows_per_table, total_D,
                                         max_D, indices, offsets, pooling_mode, per_sample_weights, output_dtype)


_tbe_lookup = torch.library.custom_op(_LOOKUP_OP, _tbe_lookup_impl, mutates_args=(), schema=_LOOKUP_SCHEMA)


@_tbe_lookup.register_fake
def _tbe_lookup_fake(weights, placeholder, weights_offsets, D_offsets, rows_per_table, row_offsets, total_rows,
                     total_D, max_D, indices, offsets, pooling_mode, per_sample_weights, output_dtype, *optimizer):
    return _tbe_forward_fake(weights.reshape(-1), weights_offsets, D_offsets, rows_per_table, total_D, max_D, indices,
                             offsets, pooling_mode, per_sample_weights, output_dtype)


def _tbe_lookup_setup_context(ctx, inputs, output):
    # As TBELookupFunction: indices, offsets and the per-sample weights saved (version-checked); the tables
    # and the state held as they are, since the backward updates them in place.
    ctx.save_for_backward(inputs[9], inputs[10], inputs[_LOOKUP_PSW])
    ctx.inputs = inputs


def _tbe_lookup_backward(ctx, grad_output):
    (weights, _, weights_offsets, D_offsets, rows_per_table, row_offsets, total_rows, total_D, max_D, _, _,
     pooling_mode, _, _, optimizer, momentum1, momentum2, learning_rate, eps, beta1, beta2, weight_decay,
     weight_decay_mode, stochastic_rounding, optimizer_counters, eta, momentum, max_norm, gradient_clipping,
     max_gradient) = ctx.inputs
    indices, offsets, per_sample_weights = ctx.saved_tensors
    if gradient_clipping:
        grad_output = grad_output.clamp(-max_gradient, max_gradient)
    grad_output = grad_output.contiguous()
    metadata = (weights_offsets, D_offsets, rows_per_table, row_offsets, total_rows, total_D, max_D)
    lookup = (indices, offsets, pooling_mode, per_sample_weights)
    flat = weights.detach().reshape(-1)
    grad_weights = None
    if optimizer in _FUSED and ctx.needs_input_grad[_LOOKUP_PLACEHOLDER]:
        grad_psw = torch.ops.hipdlrm.tbe_backward(
            grad_output, flat, *metadata, *lookup, optimizer, momentum1, momentum2, learning_rate, eps,
            beta1, beta2, weight_decay, weight_decay_mode, stochastic_rounding, optimizer_counters, eta, momentum,
            max_norm)
    else:
        element, values, grad_psw = torch.ops.hipdlrm.tbe_backward_sparse(grad_output, flat, *metadata, *lookup)
        if ctx.needs_input_grad[0] and weights.dim() == 1:
            # The module's flat weights: TableBatchedEmbedding._sparse_gradient's layout.
            grad_weights = torch.sparse_coo_tensor(element.unsqueeze(0), values, (weights.numel(),),
                                                   check_invariants=False, is_coalesced=False)
        elif ctx.needs_input_grad[0]:
            # [rows, dim] weights (hipdlrm.fbgemm's weights_dev: tables back to back, one dim): FBGEMM's
            # row-sparse COO, one row of values per looked-up row (ascending), then the zero padding rows.
            dim = weights.shape[1]
            rows = torch.div(element.view(-1, dim)[:, 0], dim, rounding_mode="floor")
            grad_weights = torch.sparse_coo_tensor(rows.unsqueeze(0), values.view(-1, dim), tuple(weights.shape),
                                                   check_invariants=False, is_coalesced=False)
    if not ctx.needs_input_grad[_LOOKUP_PSW]:
        grad_psw = None
    grad_placeholder = (grad_output.new_zeros(0, dtype=torch.float32) if ctx.needs_input_grad[_LOOKUP_PLACEHOLDER]
                        else None)
    grads = [None] * len(ctx.inputs)
    grads[0], grads[_LOOKUP_PLACEHOLDER], grads[_LOOKUP_PSW] = grad_weights, grad_placeholder, grad_psw
    return tuple(grads)


_tbe_lookup.register_autograd(_tbe_lookup_backward, setup_context=_tbe_lookup_setup_context)


# ---- the module ----------------------------------------------------------------------------------------

def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _whole_number(value, what: str) -> int:
    """An int, or a float / 0-d tensor holding one; anything else is a clear error naming `what`."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not (math.isfinite(value) and value == int(value))):
        raise ValueError(f"{what} must be a whole number, got {value!r}")
    return int(value)


def _finite(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


class TableBatchedEmbedding(nn.Module):
    """Pooled (SUM, MEAN) or sequence (NONE) lookups over many embedding tables in one operator call.

    Args:
        embedding_specs: one ``(num_rows, dim)`` per table; any dim >= 1 (dims whose rows are a multiple
            of 16 bytes take the fastest path on the GPU).
        feature_table_map: the table of each feature of the input layout (several features may share a
            table); default: feature t uses table t.
        pooling_mode: ``PoolingMode.SUM``, ``MEAN`` or ``NONE`` (NONE needs every feature's dim equal).
        weights_precision: dtype of the tables: float32, float16 or bfloat16. It stays theirs: module
            dtype casts (``.half()``, ``.to(dtype)``, ``.float()``) move the tables and the optimizer state
            between devices but change neither the tables' precision nor the fp32 state.
        output_dtype: dtype of the output: float32, float16 or bfloat16 (accumulation is always fp32).
        bounds_check_mode: how ``forward`` treats bad indices and offsets (``BoundsCheckMode``): FATAL
            raises; WARNING repairs them in the caller's tensors (an out-of-range index becomes 0, as
            FBGEMM does) and prints a line; IGNORE repairs silently. Index -1 is a pruned row and
            contributes nothing.
        device: where the tables live; default the current CUDA device if there is one, else the CPU.
        optimizer: the update fused into the backward (``OptimType``): ``loss.backward()`` updates the
            tables in place. ``OptimType.NONE`` gives ``weights.grad`` a sparse gradient instead; ``None``
            makes an inference-only module (weights that do not require grad).
        learning_rate, eps, weight_decay, weight_decay_mode, beta1, beta2: the optimizer's settings
            (beta1/beta2: the Adams only; eps: the Adagrads and the Adams; LARS_SGD's weight decay is its
            own, in the trust ratio too, with weight_decay_mode L2).
        eta, momentum: LARS_SGD's trust coefficient (> 0) and momentum (in [0, 1)); FBGEMM's defaults.
        max_norm: EXACT_ROWWISE_ADAGRAD only (as FBGEMM's): after its update, a looked-up row whose L2 norm
            exceeds ``max_norm`` is scaled to norm ``max_norm``; 0 (the default) bounds nothing.
        gradient_clipping, max_gradient: with ``gradient_clipping``, the gradient of the lookup's output is
            clamped element by element to ``[-max_gradient, max_gradient]`` (``max_gradient > 0``) before
            the backward, as FBGEMM clips it.
        stochastic_rounding: fp16/bf16 weights are rounded stochastically (seeded, reproducible) after
            each update, instead of to nearest.
        optimizer_state_dtypes: ``{"momentum1": dtype, "momentum2": dtype}`` (either key optional): with
            ``OptimType.PARTIAL_ROWWISE_ADAM`` a state may be kept in float16 or bfloat16 instead of
            float32, as FBGEMM allows (read into fp32, updated in fp32, stored rounded to nearest); every
            other optimizer's state is float32.

    Attributes: ``weights`` (the flat tables, an ``nn.Parameter``; it requires grad only with
    ``OptimType.NONE``, whose backward gives it a sparse gradient), ``placeholder_autograd_tensor`` (with a
    fused optimizer: an empty parameter that connects the lookup to autograd, so that ``loss.backward()``
    runs the update while no gradient the size of the tables exists, for DDP to bucket or for
    AOTAutograd to see on a mutated leaf; ``requires_grad_(False)`` on it, or on the module, freezes the
    tables; it is not part of ``state_dict()``), the optimizer state (``split_optimizer_states()``; buffers ``momentum1``, ``momentum2`` and
    ``optimizer_counters`` = [step, seed], all in ``state_dict()``), and the per-feature buffers
    ``weights_offsets`` (int64), ``D_offsets`` (int32, T + 1 entries), ``rows_per_table`` and
    ``row_offsets`` (int64) that the ops take.
    """

    def __init__(
        self,
        embedding_specs: Sequence[Tuple[int, int]],
        feature_table_map: Optional[Sequence[int]] = None,
        pooling_mode: Union[PoolingMode, int] = PoolingMode.SUM,
        weights_precision: torch.dtype = torch.float32,
        output_dtype: torch.dtype = torch.float32,
        bounds_check_mode: Union[BoundsCheckMode, int] = BoundsCheckMode.WARNING,
        device: Optional[Union[str, int, torch.device]] = None,
        optimizer: Optional[Union[OptimType, int]] = OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate: float = 0.01,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        weight_decay_mode: Union[WeightDecayMode, int] = WeightDecayMode.NONE,
        beta1: float = 0.9,
        beta2: float = 0.999,
        stochastic_rounding: bool = True,
        eta: float = 0.001,
        momentum: float = 0.9,
        max_norm: float = 0.0,
        gradient_clipping: bool = False,
        max_gradient: float = 1.0,
        optimizer_state_dtypes: Optional[Dict[str, torch.dtype]] = None,
    ) -> None:
        super().__init__()
        specs = self._validate_specs(embedding_specs)
        if feature_table_map is None:
            feature_table_map = list(range(len(specs)))
        feature_table_map = [_whole_number(t, f"feature_table_map[{f}]") for f, t in enumerate(feature_table_map)]
        if not feature_table_map:
            raise ValueError("feature_table_map must name at least one table")
        for f, t in enumerate(feature_table_map):
            if not 0 <= t < len(specs):
                raise ValueError(f"feature_table_map[{f}] = {t} is not a table index (there are {len(specs)} tables)")
        if weights_precision not in _FLOAT_FORMATS:
            raise ValueError(f"weights_precision must be torch.float32, float16 or bfloat16, got {weights_precision}")
        if output_dtype not in _FLOAT_FORMATS:
            raise ValueError(f"output_dtype must be torch.float32, float16 or bfloat16, got {output_dtype}")
        self.pooling_mode = PoolingMode(pooling_mode)
        self.bounds_check_mode = BoundsCheckMode(bounds_check_mode)
        dims = [specs[t][1] for t in feature_table_map]
        if self.pooling_mode == PoolingMode.NONE and len(set(dims)) != 1:
            raise ValueError(f"pooling_mode NONE needs every feature to have the same dim, got dims {dims}")

        self.embedding_specs: List[Tuple[int, int]] = specs
        self.feature_table_map: List[int] = feature_table_map
        self.weights_precision = weights_precision
        self.output_dtype = output_dtype
        self.num_features = len(feature_table_map)
        self.total_D = sum(dims)
        self.max_D = max(dims)
        if self.total_D >= 2**31:
            raise ValueError(f"the sum of the features' dims must be below 2**31, got {self.total_D}")

        # Tables never overlap: in the flat weights (table_offsets, aligned) nor in the row space
        # (table_row_offsets), which numbers every row of every table once.
        align = _TABLE_ALIGN_BYTES // torch.empty((), dtype=weights_precision).element_size()
        # Lists of ints (not annotated here: torch.jit.script warns on an annotated empty list in __init__).
        self.table_offsets = []
        self.table_row_offsets = []
        size = rows_total = 0
        for rows, dim in specs:
            size = (size + align - 1) // align * align
            self.table_offsets.append(size)
            self.table_row_offsets.append(rows_total)
            size += rows * dim
            rows_total += rows
        self.total_rows = rows_total

        device = _default_device() if device is None else torch.device(device)
        self.weights = nn.Parameter(torch.zeros(size, dtype=weights_precision, device=device), requires_grad=False)

        def per_feature(values, dtype=torch.int64):
            return torch.tensor(values, dtype=dtype, device=device)

        d_offsets = [0]
        for d in dims:
            d_offsets.append(d_offsets[-1] + d)
        self.register_buffer("weights_offsets", per_feature([self.table_offsets[t] for t in feature_table_map]),
                             persistent=False)
        self.register_buffer("D_offsets", per_feature(d_offsets, torch.int32), persistent=False)
        self.register_buffer("rows_per_table", per_feature([specs[t][0] for t in feature_table_map]),
                             persistent=False)
        self.register_buffer("row_offsets", per_feature([self.table_row_offsets[t] for t in feature_table_map]),
                             persistent=False)
        self.register_buffer("bounds_check_warning", torch.zeros(1, dtype=torch.int64, device=device),
                             persistent=False)
        self._init_optimizer(optimizer, learning_rate, eps, weight_decay, weight_decay_mode, beta1, beta2,
                             stochastic_rounding, eta, momentum, max_norm, gradient_clipping, max_gradient,
                             optimizer_state_dtypes)

    @staticmethod
    def _validate_specs(embedding_specs) -> List[Tuple[int, int]]:
        specs = []
        for i, spec in enumerate(embedding_specs):
            try:
                rows, dim = spec
            except (TypeError, ValueError):
                raise ValueError(f"embedding_specs[{i}] must be a (num_rows, dim) pair, got {spec!r}") from None
            rows = _whole_number(rows, f"embedding_specs[{i}]'s num_rows")
            dim = _whole_number(dim, f"embedding_specs[{i}]'s dim")
            if rows < 1 or dim < 1:
                raise ValueError(f"embedding_specs[{i}] = ({rows}, {dim}): num_rows and dim must be >= 1")
            specs.append((rows, dim))
        if not specs:
            raise ValueError("embedding_specs must describe at least one table")
        return specs

    def _init_optimizer(self, optimizer, learning_rate, eps, weight_decay, weight_decay_mode, beta1, beta2,
                        stochastic_rounding, eta, momentum, max_norm, gradient_clipping, max_gradient,
                        optimizer_state_dtypes=None) -> None:
        """The optimizer's settings and state. ``optimizer=None``: inference only, no state. State:
        ``momentum1`` (row-wise Adagrad: one fp32 per row of every table; the Adams and Adagrad: one per
        weight; LARS: one per weight), ``momentum2`` (Adam and LAMB: one per weight; the partial row-wise Adam
        and LAMB: one per row) and ``optimizer_counters`` = [step, seed] (int64), all persistent."""
        self.optimizer = None if optimizer is None else OptimType(optimizer)
        self.weight_decay_mode = WeightDecayMode(weight_decay_mode)
        self.learning_rate = _finite(learning_rate, "learning_rate")
        self.eps = _finite(eps, "eps")
        self.weight_decay = _finite(weight_decay, "weight_decay")
        self.beta1 = _finite(beta1, "beta1")
        self.beta2 = _finite(beta2, "beta2")
        self.stochastic_rounding = bool(stochastic_rounding)
        self.eta = _finite(eta, "eta")
        self.momentum = _finite(momentum, "momentum")
        self.max_norm = _finite(max_norm, "max_norm")
        self.gradient_clipping = bool(gradient_clipping)
        self.max_gradient = _finite(max_gradient, "max_gradient")
        if self.max_norm < 0:
            raise ValueError(f"max_norm must be >= 0 (0: no bound), got {max_norm}")
        if self.max_norm > 0 and self.optimizer != OptimType.EXACT_ROWWISE_ADAGRAD:
            name = "None" if self.optimizer is None else f"OptimType.{self.optimizer.name}"
            raise ValueError(f"max_norm={max_norm} bounds the rows of OptimType.EXACT_ROWWISE_ADAGRAD only (as "
                             f"FBGEMM's), got optimizer={name}; pass max_norm=0")
        if self.gradient_clipping and self.max_gradient <= 0:
            raise ValueError(f"max_gradient must be > 0 with gradient_clipping, got {max_gradient}")
        if self.optimizer in (OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.EXACT_ADAGRAD) + _ADAMS and self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        if self.optimizer in _ADAMS and not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"beta1 and beta2 must be in [0, 1), got {beta1} and {beta2}")
        if self.optimizer == OptimType.LARS_SGD:
            if self.eta <= 0:
                raise ValueError(f"eta must be > 0, got {eta}")
            if not 0 <= self.momentum < 1:
                raise ValueError(f"momentum must be in [0, 1), got {momentum}")
            if self.weight_decay_mode == WeightDecayMode.DECOUPLED:
                raise ValueError("weight_decay_mode=DECOUPLED with LARS_SGD: its weight decay is part of its trust "
                                 "ratio; use WeightDecayMode.L2")
        if self.optimizer is None:
            return
        if self.optimizer == OptimType.NONE:
            self.weights.requires_grad_(True)
        else:
            self.placeholder_autograd_tensor = nn.Parameter(torch.zeros(0, dtype=torch.float32,
                                                                        device=self.weights.device))
        state_dtypes = self._state_dtypes(optimizer_state_dtypes)
        f32 = dict(dtype=torch.float32, device=self.weights.device)
        if self.optimizer == OptimType.EXACT_ROWWISE_ADAGRAD:
            self.register_buffer("momentum1", torch.zeros(self.total_rows, **f32))
        elif self.optimizer in (OptimType.ADAM, OptimType.LAMB):
            self.register_buffer("momentum1", torch.zeros(self.weights.numel(), **f32))
            self.register_buffer("momentum2", torch.zeros(self.weights.numel(), **f32))
        elif self.optimizer in (OptimType.EXACT_ADAGRAD, OptimType.LARS_SGD):
            self.register_buffer("momentum1", torch.zeros(self.weights.numel(), **f32))
        elif self.optimizer in _PARTIAL_ROWWISE:
            self.register_buffer("momentum1", torch.zeros(self.weights.numel(), dtype=state_dtypes["momentum1"],
                                                          device=self.weights.device))
            self.register_buffer("momentum2", torch.zeros(self.total_rows, dtype=state_dtypes["momentum2"],
                                                          device=self.weights.device))
        seed = int(torch.randint(0, 2**62, (1,)).item())
        self.register_buffer("optimizer_counters", torch.tensor([0, seed], dtype=torch.int64,
                                                                device=self.weights.device))

    def _state_dtypes(self, optimizer_state_dtypes) -> Dict[str, torch.dtype]:
        """The dtype of each state: float32, but PARTIAL_ROWWISE_ADAM may keep ``momentum1`` and / or
        ``momentum2`` in float16 or bfloat16 (FBGEMM's ``optimizer_state_dtypes``; updated in fp32, stored
        rounded to nearest)."""
        dtypes = {"momentum1": torch.float32, "momentum2": torch.float32}
        if not optimizer_state_dtypes:
            return dtypes
        if not isinstance(optimizer_state_dtypes, dict):
            raise ValueError(f"optimizer_state_dtypes must be a dict {{'momentum1' / 'momentum2': dtype}}, got "
                             f"{type(optimizer_state_dtypes).__name__}")
        for key, dtype in optimizer_state_dtypes.items():
            if key not in dtypes:
                raise ValueError(f"optimizer_state_dtypes: unknown state {key!r} (the states are 'momentum1' and "
                                 f"'momentum2')")
            if dtype not in _FLOAT_FORMATS:
                raise ValueError(f"optimizer_state_dtypes[{key!r}] must be torch.float32, float16 or bfloat16, "
                                 f"got {dtype!r}")
            if dtype != torch.float32 and self.optimizer != OptimType.PARTIAL_ROWWISE_ADAM:
                name = "None" if self.optimizer is None else f"OptimType.{self.optimizer.name}"
                raise ValueError(f"optimizer_state_dtypes[{key!r}] = {dtype}: only OptimType.PARTIAL_ROWWISE_ADAM "
                                 f"keeps a narrower state (as in FBGEMM), got optimizer={name}")
            dtypes[key] = dtype
        return dtypes

    # ---- the ops' arguments, built in one place each ----

    def _lookup_metadata(self) -> tuple:
        """The backward ops' arguments between ``weights`` and ``indices``."""
        return (self.weights_offsets, self.D_offsets, self.rows_per_table, self.row_offsets, self.total_rows,
                self.total_D, self.max_D)

    def _optimizer_arguments(self) -> tuple:
        """tbe_backward's arguments after ``per_sample_weights`` (the op advances the step itself)."""
        none = torch.empty(0, dtype=torch.float32, device=self.weights.device)
        return (int(self.optimizer), getattr(self, "momentum1", none), getattr(self, "momentum2", none),
                self.learning_rate, self.eps, self.beta1, self.beta2, self.weight_decay, int(self.weight_decay_mode),
                self.stochastic_rounding, self.optimizer_counters, self.eta, self.momentum, self.max_norm)

    # ---- nn.Module hooks: dtype casts, checkpoints ----

    def _apply(self, fn, recurse=True):
        """Module casts keep the tables' precision and the fp32 state: a conversion that would change a
        tensor's dtype only moves it to the device it would have gone to (the module's floating tensors
        are exactly the tables, their gradient and the optimizer state)."""
        def keep_dtype(t):
            converted = fn(t)
            if isinstance(converted, torch.Tensor) and converted.dtype != t.dtype:
                return t.to(device=converted.device)
            return converted
        return super()._apply(keep_dtype, recurse)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Checks every tensor of this module's state first (present, shape, dtype), so that a state of
        other specs, another optimizer or a wrong dtype raises naming the key and changes nothing."""
        for name, tensor in [("weights", self.weights)] + [(n, b) for n, b in self._buffers.items()
                                                           if n not in self._non_persistent_buffers_set]:
            key = prefix + name
            if key not in state_dict:
                if strict:
                    raise KeyError(f"load_state_dict: {key} is missing (this module keeps "
                                   f"{', '.join(self.state_dict().keys())})")
                continue
            value = state_dict[key]
            if not isinstance(value, torch.Tensor) or value.shape != tensor.shape or value.dtype != tensor.dtype:
                got = (f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                       else type(value).__name__)
                raise ValueError(f"load_state_dict: {key} must be {tensor.dtype} of shape {tuple(tensor.shape)} "
                                 f"({self._state_description(name)}), got {got}")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if prefix + _PLACEHOLDER in missing_keys:
            missing_keys.remove(prefix + _PLACEHOLDER)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination.pop(prefix + _PLACEHOLDER, None)  # it holds nothing: checkpoints keep the keys they had

    def _state_description(self, name: str) -> str:
        if name == "weights":
            return f"tables {self.embedding_specs} in {self.weights_precision}, 128-byte aligned"
        if name == "optimizer_counters":
            return "[step, seed]"
        return f"{self.optimizer.name}'s state"

    def _forward_op(self, weights, indices, offsets, per_sample_weights, vbe=None) -> torch.Tensor:
        """tbe_forward; ``vbe``: (batch sizes, output size), the VBE lookup's 1-D output (hipdlrm.fbgemm)."""
        batch_sizes, output_size = (None, -1) if vbe is None else vbe
        return torch.ops.hipdlrm.tbe_forward(weights, self.weights_offsets, self.D_offsets, self.rows_per_table,
                                             self.total_D, self.max_D, indices, offsets, int(self.pooling_mode),
                                             per_sample_weights, self.output_dtype, batch_sizes, output_size)

    def _lookup_weights(self) -> torch.Tensor:
        """The tables as the lookup's autograd input (``TBELookupFunction``'s ``weights``): the flat
        ``weights``, to which OptimType.NONE's backward gives ``_sparse_gradient``. A subclass may return
        another view of the same storage instead (hipdlrm.fbgemm's ``[rows, dim]`` ``weights_dev``); its
        ``_forward_op`` then receives that view."""
        return self.weights

    def _sparse_gradient(self, element: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """OptimType.NONE: ``tbe_backward_sparse``'s (element indices, values) as the gradient of
        ``_lookup_weights()``: here a 1-D sparse COO over the elements of the flat weights
        (``[weights.numel()]``, alignment gaps included): the looked-up rows' elements, then zero-valued
        padding at an element already in it (docs/tbe.md), so it is not coalesced."""
        return torch.sparse_coo_tensor(element.unsqueeze(0), values, (self.weights.numel(),),
                                       check_invariants=False, is_coalesced=False)

    # ---- public API ----

    @torch.jit.export
    def split_embedding_weights(self) -> List[torch.Tensor]:
        """One ``[num_rows, dim]`` view per table into the flat weights (writes reach the real storage)."""
        if torch.jit.is_scripting():
            return self._scripted_split_embedding_weights()
        flat = self.weights.detach()
        return [flat[off:off + rows * dim].view(rows, dim)
                for off, (rows, dim) in zip(self.table_offsets, self.embedding_specs)]

    @torch.jit.export
    def split_optimizer_states(self) -> List[List[torch.Tensor]]:
        """Per table, views of its optimizer state (writes reach the module's buffers): row-wise Adagrad
        ``[momentum1 [rows]]``, Adam and LAMB ``[momentum1 [rows, dim], momentum2 [rows, dim]]``, Adagrad
        and LARS ``[momentum1 [rows, dim]]``, the partial row-wise Adam and LAMB ``[momentum1 [rows, dim],
        momentum2 [rows]]``, SGD and NONE ``[]``."""
        if torch.jit.is_scripting():
            return self._scripted_split_optimizer_states()
        states: List[List[torch.Tensor]] = []
        for t, (rows, dim) in enumerate(self.embedding_specs):
            if self.optimizer == OptimType.EXACT_ROWWISE_ADAGRAD:
                start = self.table_row_offsets[t]
                states.append([self.momentum1.detach()[start:start + rows]])
            elif self.optimizer in (OptimType.ADAM, OptimType.EXACT_ADAGRAD, OptimType.LARS_SGD, OptimType.LAMB):
                start = self.table_offsets[t]
                two = self.optimizer in (OptimType.ADAM, OptimType.LAMB)
                element_states = (self.momentum1, self.momentum2) if two else (
                    self.momentum1,)
                states.append([m.detach()[start:start + rows * dim].view(rows, dim) for m in element_states])
            elif self.optimizer in _PARTIAL_ROWWISE:
                start, row_start = self.table_offsets[t], self.table_row_offsets[t]
                states.append([self.momentum1.detach()[start:start + rows * dim].view(rows, dim),
                               self.momentum2.detach()[row_start:row_start + rows]])
            else:
                states.append([])
        return states

    @torch.no_grad()
    def init_embedding_weights_uniform(self, min_val: float, max_val: float) -> None:
        """Fills every table with values drawn uniformly from [min_val, max_val)."""
        for table in self.split_embedding_weights():
            table.uniform_(min_val, max_val)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Looks up every bag: ``[B, total_D]`` for SUM / MEAN, ``[len(indices), dim]`` for NONE.

        ``indices`` and ``offsets`` are int32 or int64 (converted to int64 when they differ);
        ``offsets`` has ``T * B + 1`` entries; ``per_sample_weights`` (float32, one per index) scales each
        row. Indices and offsets are bounds-checked first in ``bounds_check_mode``: WARNING and IGNORE
        repair them in the caller's tensors, as FBGEMM does (also when they had to be converted or made
        contiguous for the lookup: the repaired values are copied back).
        """
        if torch.jit.is_scripting():
            return self._scripted_forward(indices, offsets, per_sample_weights)
        self._check_inputs(indices, offsets, per_sample_weights)
        idx, off = self._bounds_check_inputs(indices, offsets)
        return self._lookup(idx, off, per_sample_weights)

    def _lookup(self, indices: torch.Tensor, offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor],
                vbe=None) -> torch.Tensor:
        """The lookup of checked inputs, through TBELookupFunction when something needs its backward.
        ``vbe``: _forward_op's."""
        placeholder = getattr(self, _PLACEHOLDER, None)
        weights = self._lookup_weights()
        if torch.is_grad_enabled() and (weights.requires_grad or (
                placeholder is not None and placeholder.requires_grad) or (
                per_sample_weights is not None and per_sample_weights.requires_grad)):
            return TBELookupFunction.apply(self, indices, offsets, weights, per_sample_weights, placeholder, vbe)
        return self._forward_op(self.weights, indices, offsets, per_sample_weights, vbe)

    def _check_inputs(self, indices: torch.Tensor, offsets: torch.Tensor,
                      per_sample_weights: Optional[torch.Tensor], vbe: bool = False) -> None:
        """Eager: what is not a tensor at all, then the checks a scripted module runs too (``vbe``: the
        offsets' count follows the batch sizes, checked by the caller)."""
        for name, t in (("indices", indices), ("offsets", offsets), ("per_sample_weights", per_sample_weights)):
            if not isinstance(t, torch.Tensor) and not (name == "per_sample_weights" and t is None):
                raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        self._scripted_check_inputs(indices, offsets, per_sample_weights, vbe)

    def extra_repr(self) -> str:
        return (f"tables={len(self.embedding_specs)}, features={self.num_features}, total_D={self.total_D}, "
                f"pooling_mode={self.pooling_mode.name}, weights_precision={self.weights_precision}, "
                f"output_dtype={self.output_dtype}, bounds_check_mode={self.bounds_check_mode.name}, "
                f"optimizer={None if self.optimizer is None else self.optimizer.name}")

    # ---- TorchScript (docs/tbe.md, "TorchScript") ----
    # torch.jit.script compiles the torch.jit.is_scripting() branch of forward and of the exported methods,
    # which call these; eager and torch.compile'd modules never run them. In TorchScript the module's
    # IntEnum attributes are ints (compared with the members' .value) and its torch dtypes ScalarTypes. The
    # checks are _check_inputs' (a scripted module raises torch.jit.Error carrying the message).

    def _scripted_forward(self, indices: torch.Tensor, offsets: torch.Tensor,
                          per_sample_weights: Optional[torch.Tensor]) -> torch.Tensor:
        self._scripted_check_inputs(indices, offsets, per_sample_weights)
        idx, off = self._bounds_check_inputs(indices, offsets)
        return self._scripted_lookup(idx, off, per_sample_weights)

    def _scripted_check_index_tensor(self, name: str, t: torch.Tensor) -> None:
        if t.dim() != 1 or (t.dtype != torch.int32 and t.dtype != torch.int64):
            raise ValueError(f"{name} must be a 1-D int32 or int64 tensor, got {_dtype_name(t.dtype)} tensor of "
                             f"shape {_shape_text(t)}")
        if t.device != self.weights.device:
            raise ValueError(f"{name} is on {t.device} but the tables are on {self.weights.device}")

    def _scripted_check_inputs(self, indices: torch.Tensor, offsets: torch.Tensor,
                               per_sample_weights: Optional[torch.Tensor], vbe: bool = False) -> None:
        self._scripted_check_index_tensor("indices", indices)
        self._scripted_check_index_tensor("offsets", offsets)
        if not vbe and (offsets.numel() < 1 or (offsets.numel() - 1) % self.num_features != 0):
            raise ValueError(f"offsets must have T * B + 1 entries (T = {self.num_features} features), "
                             f"got {offsets.numel()}")
        if per_sample_weights is not None:
            if per_sample_weights.dtype != torch.float32 or per_sample_weights.dim() != 1:
                raise ValueError(f"per_sample_weights must be a 1-D float32 tensor, got "
                                 f"{_dtype_name(per_sample_weights.dtype)} of shape {_shape_text(per_sample_weights)}")
            if per_sample_weights.numel() != indices.numel():
                raise ValueError(f"per_sample_weights must have one entry per index ({indices.numel()}), "
                                 f"got {per_sample_weights.numel()}")
            if per_sample_weights.device != self.weights.device:
                raise ValueError(f"per_sample_weights is on {per_sample_weights.device} but the tables are on "
                                 f"{self.weights.device}")

    def _bounds_check_inputs(self, indices: torch.Tensor, offsets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """forward's conversion and bounds check, eager and scripted (repairs copied back into the caller's
        tensors)."""
        idx, off = indices, offsets
        if idx.dtype != off.dtype:
            idx, off = idx.long(), off.long()
        idx, off = idx.contiguous(), off.contiguous()
        torch.ops.hipdlrm.bounds_check_indices(self.rows_per_table, idx, off, int(self.bounds_check_mode),
                                               self.bounds_check_warning, None, None, -1)
        if int(self.bounds_check_mode) != BoundsCheckMode.FATAL.value:
            if idx is not indices:
                indices.copy_(idx)
            if off is not offsets:
                offsets.copy_(off)
        return idx, off

    def _scripted_optimizer(self) -> int:
        """The optimizer's code, -1 for an inference-only module (optimizer=None)."""
        optimizer = self.optimizer
        if optimizer is None:
            return -1
        return int(optimizer)

    def _scripted_lookup(self, indices: torch.Tensor, offsets: torch.Tensor,
                         per_sample_weights: Optional[torch.Tensor]) -> torch.Tensor:
        """The lookup of checked inputs: tbe_lookup (the fused update or the sparse gradient in its
        backward) when forward would call TBELookupFunction, else tbe_forward."""
        device = self.weights.device
        placeholder = torch.empty(0, dtype=torch.float32, device=device)
        momentum1, momentum2 = placeholder, placeholder
        counters = torch.empty(0, dtype=torch.int64, device=device)
        if hasattr(self, "placeholder_autograd_tensor"):
            placeholder = self.placeholder_autograd_tensor
        if hasattr(self, "momentum1"):
            momentum1 = self.momentum1
        if hasattr(self, "momentum2"):
            momentum2 = self.momentum2
        if hasattr(self, "optimizer_counters"):
            counters = self.optimizer_counters
        weights = self._scripted_lookup_weights()
        requires_grad = weights.requires_grad or placeholder.requires_grad
        if per_sample_weights is not None:
            requires_grad = requires_grad or per_sample_weights.requires_grad
        if torch.is_grad_enabled() and requires_grad:
            return torch.ops.hipdlrm.tbe_lookup(
                weights, placeholder, self.weights_offsets, self.D_offsets, self.rows_per_table,
                self.row_offsets, self.total_rows, self.total_D, self.max_D, indices, offsets,
                int(self.pooling_mode), per_sample_weights, self.output_dtype, self._scripted_optimizer(), momentum1,
                momentum2, self.learning_rate, self.eps, self.beta1, self.beta2, self.weight_decay,
                int(self.weight_decay_mode), self.stochastic_rounding, counters, self.eta, self.momentum,
                self.max_norm, self.gradient_clipping, self.max_gradient)
        return torch.ops.hipdlrm.tbe_forward(self.weights, self.weights_offsets, self.D_offsets, self.rows_per_table,
                                             self.total_D, self.max_D, indices, offsets, int(self.pooling_mode),
                                             per_sample_weights, self.output_dtype)

    def _scripted_lookup_weights(self) -> torch.Tensor:
        """_lookup_weights()."""
        return self.weights

    def _scripted_split_embedding_weights(self) -> List[torch.Tensor]:
        flat = self.weights.detach()
        tables: List[torch.Tensor] = []
        for t in range(len(self.embedding_specs)):
            rows, dim = self.embedding_specs[t]
            start = self.table_offsets[t]
            tables.append(flat[start:start + rows * dim].view(rows, dim))
        return tables

    def _scripted_split_optimizer_states(self) -> List[List[torch.Tensor]]:
        """split_optimizer_states' views, from the states the module has: momentum1 is per row for row-wise
        Adagrad, momentum2 per row for the partial row-wise optimizers, both per element otherwise."""
        optimizer = self._scripted_optimizer()
        states: List[List[torch.Tensor]] = []
        for t in range(len(self.embedding_specs)):
            rows, dim = self.embedding_specs[t]
            start, row_start = self.table_offsets[t], self.table_row_offsets[t]
            table: List[torch.Tensor] = []
            if hasattr(self, "momentum1"):
                if optimizer == OptimType.EXACT_ROWWISE_ADAGRAD.value:
                    table.append(self.momentum1.detach()[row_start:row_start + rows])
                else:
                    table.append(self.momentum1.detach()[start:start + rows * dim].view(rows, dim))
            if hasattr(self, "momentum2"):
                if (optimizer == OptimType.PARTIAL_ROWWISE_ADAM.value
                        or optimizer == OptimType.PARTIAL_ROWWISE_LAMB.value):
                    table.append(self.momentum2.detach()[row_start:row_start + rows])
                else:
                    table.append(self.momentum2.detach()[start:start + rows * dim].view(rows, dim))
            states.append(table)
        return states


def _shape_text(t: torch.Tensor) -> str:
    """A shape as eager messages print it, (3,) or (2, 4), in eager and TorchScript alike."""
    dims = [str(d) for d in t.shape]
    return "(" + (dims[0] + "," if len(dims) == 1 else ", ".join(dims)) + ")"


def _dtype_name(dtype: torch.dtype) -> str:
    """A dtype as eager error messages print it (TorchScript formats a dtype as its code)."""
    for name, known in (("torch.float32", torch.float32), ("torch.float16", torch.float16),
                        ("torch.bfloat16", torch.bfloat16), ("torch.float64", torch.float64),
                        ("torch.int32", torch.int32), ("torch.int64", torch.int64), ("torch.int16", torch.int16),
                        ("torch.int8", torch.int8), ("torch.uint8", torch.uint8), ("torch.bool", torch.bool)):
        if dtype == known:
            return name
    return "a tensor of another dtype"
