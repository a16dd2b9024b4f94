"""Training for hipdlrm's Table Batched Embedding: the backward with the optimizer fused in (docs/tbe.md,
"Backward").

``TableBatchedEmbedding(..., optimizer=OptimType.EXACT_ROWWISE_ADAGRAD, ...)`` makes ``loss.backward()``
update the tables in place: the module's forward goes through ``TBELookupFunction``, whose backward calls

    torch.ops.hipdlrm.tbe_backward(grad_output, weights, weights_offsets, D_offsets, rows_per_table,
        row_offsets, total_rows, total_D, max_D, indices, offsets, pooling_mode, per_sample_weights,
        optimizer, momentum1, momentum2, learning_rate, eps, beta1, beta2, weight_decay,
        weight_decay_mode, step, stochastic_rounding, seed) -> grad_per_sample_weights

which mutates ``weights``, ``momentum1`` and ``momentum2`` and returns the gradient of the per-sample
weights (empty when there are none). With ``OptimType.NONE`` the backward instead calls

    torch.ops.hipdlrm.tbe_backward_sparse(grad_output, weights, ..., per_sample_weights)
        -> (element_indices, values, grad_per_sample_weights)

and hands autograd a sparse COO gradient of the flat ``weights`` for an external optimizer.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING, List, Optional

import torch

if TYPE_CHECKING:
    from .tbe import TableBatchedEmbedding

__all__ = ["OptimType", "WeightDecayMode", "TBELookupFunction"]


class OptimType(enum.IntEnum):
    """The optimizer fused into the backward (the codes are the op's ``optimizer`` argument).

    NONE: no update; ``weights.grad`` receives a sparse COO gradient. EXACT_SGD: ``w -= lr * g``.
    EXACT_ROWWISE_ADAGRAD: one fp32 state per row, ``s += mean(g^2)``, ``w -= lr * g / (sqrt(s) + eps)``.
    ADAM: two fp32 states per element, bias-corrected with the module's step counter. "Exact": only
    rows looked up in the batch are updated, each once with the sum of its gradients.
    """

    NONE = 0
    EXACT_SGD = 1
    EXACT_ROWWISE_ADAGRAD = 2
    ADAM = 3


class WeightDecayMode(enum.IntEnum):
    """FBGEMM's codes. L2 adds ``weight_decay * w`` to the gradient; DECOUPLED subtracts
    ``lr * weight_decay * w`` from the weight after the update (AdamW's form)."""

    NONE = 0
    L2 = 1
    DECOUPLED = 2


@torch.library.register_fake("hipdlrm::tbe_backward")
def _tbe_backward_fake(grad_output, weights, weights_offsets, D_offsets, rows_per_table, row_offsets, total_rows,
                       total_D, max_D, indices, offsets, pooling_mode, per_sample_weights, optimizer, momentum1,
                       momentum2, learning_rate, eps, beta1, beta2, weight_decay, weight_decay_mode, step,
                       stochastic_rounding, seed):
    n = indices.numel() if per_sample_weights is not None else 0
    return weights.new_empty((n,), dtype=torch.float32)


@torch.library.register_fake("hipdlrm::tbe_backward_sparse")
def _tbe_backward_sparse_fake(grad_output, weights, weights_offsets, D_offsets, rows_per_table, row_offsets,
                              total_rows, total_D, max_D, indices, offsets, pooling_mode, per_sample_weights):
    nnz = torch.library.get_ctx().new_dynamic_size()
    n = indices.numel() if per_sample_weights is not None else 0
    return (weights.new_empty((nnz,), dtype=torch.int64), weights.new_empty((nnz,)),
            weights.new_empty((n,), dtype=torch.float32))


# ---- autograd of the raw op -------------------------------------------------------------------------------
# The module differentiates its lookups through TBELookupFunction (below). A direct call of
# torch.ops.hipdlrm.tbe_forward on tensors that require grad gets its gradients here: the dense gradient of
# the flat weights (what an autograd op must return for a dense input; the module's sparse one avoids it) and
# that of the per-sample weights, both from tbe_backward_sparse.


def _tbe_forward_setup_context(ctx, inputs, output):
    (weights, weights_offsets, D_offsets, rows_per_table, total_D, max_D, indices, offsets, pooling_mode,
     per_sample_weights, output_dtype) = inputs
    ctx.save_for_backward(weights, weights_offsets, D_offsets, rows_per_table, indices, offsets, per_sample_weights)
    ctx.total_D, ctx.max_D, ctx.pooling_mode = total_D, max_D, pooling_mode


def _tbe_forward_backward(ctx, grad_output):
    weights, weights_offsets, D_offsets, rows_per_table, indices, offsets, per_sample_weights = ctx.saved_tensors
    # The backward sorts rows by a linear key row_offsets[t] + row. A table's weights offset serves as its
    # row_offsets entry: features of one table share it, and a table of `rows` rows of D >= 1 elements
    # spans at least `rows` offsets, so the tables' key ranges never overlap (no host read; traceable).
    row_offsets, total_rows = weights_offsets.to(torch.int64), weights.numel()
    element, values, grad_psw = torch.ops.hipdlrm.tbe_backward_sparse(
        grad_output.contiguous(), weights.detach(), weights_offsets, D_offsets, rows_per_table, row_offsets,
        total_rows, ctx.total_D, ctx.max_D, indices, offsets, ctx.pooling_mode, per_sample_weights)
    grad_weights = None
    if ctx.needs_input_grad[0]:
        # Segments ascend by row and each element appears once: a plain scatter.
        grad_weights = torch.zeros(weights.numel(), dtype=values.dtype, device=values.device)
        grad_weights = grad_weights.index_put((element,), values).view(weights.shape).to(weights.dtype)
    if per_sample_weights is None or not ctx.needs_input_grad[9]:
        grad_psw = None
    else:
        grad_psw = grad_psw.to(per_sample_weights.dtype)
    return grad_weights, None, None, None, None, None, None, None, None, grad_psw, None


torch.library.register_autograd("hipdlrm::tbe_forward", _tbe_forward_backward,
                                setup_context=_tbe_forward_setup_context)


def setup_training(module: "TableBatchedEmbedding", optimizer: Optional[OptimType], learning_rate: float,
                   eps: float, weight_decay: float, weight_decay_mode: WeightDecayMode, beta1: float, beta2: float,
                   stochastic_rounding: bool) -> None:
    """Adds the optimizer's settings and state to a freshly built module (called by its constructor).

    ``optimizer=None`` leaves an inference-only module (weights that do not require grad, no state).
    State: ``momentum1`` (row-wise Adagrad: one fp32 per row of every table; Adam: fp32 like
    ``weights``), ``momentum2`` (Adam), and ``optimizer_counters`` = [step, seed] (int64); all persistent,
    so ``state_dict()`` carries them with the weights.
    """
    module.optimizer = None if optimizer is None else OptimType(optimizer)
    module.weight_decay_mode = WeightDecayMode(weight_decay_mode)
    for name, value in (("learning_rate", learning_rate), ("eps", eps), ("weight_decay", weight_decay),
                        ("beta1", beta1), ("beta2", beta2)):
        if not isinstance(value, (int, float)) or value != value or value in (float("inf"), float("-inf")):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if module.optimizer in (OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM) and eps <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    if module.optimizer == OptimType.ADAM and not (0 <= beta1 < 1 and 0 <= beta2 < 1):
        raise ValueError(f"beta1 and beta2 must be in [0, 1), got {beta1} and {beta2}")
    module.learning_rate = float(learning_rate)
    module.eps = float(eps)
    module.weight_decay = float(weight_decay)
    module.beta1 = float(beta1)
    module.beta2 = float(beta2)
    module.stochastic_rounding = bool(stochastic_rounding)

    device = module.weights.device
    table_row_offsets = []
    total_rows = 0
    for rows, _ in module.embedding_specs:
        table_row_offsets.append(total_rows)
        total_rows += rows
    module.table_row_offsets: List[int] = table_row_offsets
    module.total_rows = total_rows
    module.register_buffer("row_offsets", torch.tensor([table_row_offsets[t] for t in module.feature_table_map],
                                                       dtype=torch.int64, device=device), persistent=False)
    if module.optimizer is None:
        return
    module.weights.requires_grad_(True)
    f32 = dict(dtype=torch.float32, device=device)
    if module.optimizer == OptimType.EXACT_ROWWISE_ADAGRAD:
        module.register_buffer("momentum1", torch.zeros(total_rows, **f32))
    elif module.optimizer == OptimType.ADAM:
        module.register_buffer("momentum1", torch.zeros(module.weights.numel(), **f32))
        module.register_buffer("momentum2", torch.zeros(module.weights.numel(), **f32))
    seed = int(torch.randint(0, 2**62, (1,)).item())
    module.register_buffer("optimizer_counters", torch.tensor([0, seed], dtype=torch.int64, device=device))
    module._host_counters = [0, seed]

    def reload_counters(mod, incompatible_keys) -> None:
        mod._host_counters = [int(v) for v in mod.optimizer_counters.tolist()]

    module.register_load_state_dict_post_hook(reload_counters)


def split_optimizer_states(module: "TableBatchedEmbedding") -> List[List[torch.Tensor]]:
    """Per table, views of its optimizer state (writes reach the module's buffers): row-wise Adagrad
    ``[momentum1 [rows]]``, Adam ``[momentum1 [rows, dim], momentum2 [rows, dim]]``, SGD and NONE ``[]``."""
    states: List[List[torch.Tensor]] = []
    for t, (rows, dim) in enumerate(module.embedding_specs):
        if module.optimizer == OptimType.EXACT_ROWWISE_ADAGRAD:
            start = module.table_row_offsets[t]
            states.append([module.momentum1.detach()[start:start + rows]])
        elif module.optimizer == OptimType.ADAM:
            start = module.table_offsets[t]
            states.append([m.detach()[start:start + rows * dim].view(rows, dim)
                           for m in (module.momentum1, module.momentum2)])
        else:
            states.append([])
    return states


def _empty_state(module: "TableBatchedEmbedding") -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=module.weights.device)


def apply_optimizer(module: "TableBatchedEmbedding", grad_output: torch.Tensor, indices: torch.Tensor,
                    offsets: torch.Tensor, per_sample_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """One fused backward + update step; returns the gradient of the per-sample weights."""
    module._host_counters[0] += 1
    step, seed = module._host_counters
    module.optimizer_counters[0].fill_(step)
    m1 = getattr(module, "momentum1", None)
    m2 = getattr(module, "momentum2", None)
    return torch.ops.hipdlrm.tbe_backward(
        grad_output, module.weights.detach(), module.weights_offsets, module.D_offsets, module.rows_per_table,
        module.row_offsets, module.total_rows, module.total_D, module.max_D, indices, offsets,
        int(module.pooling_mode), per_sample_weights, int(module.optimizer),
        m1 if m1 is not None else _empty_state(module), m2 if m2 is not None else _empty_state(module),
        module.learning_rate, module.eps, module.beta1, module.beta2, module.weight_decay,
        int(module.weight_decay_mode), step, module.stochastic_rounding, seed)


class TBELookupFunction(torch.autograd.Function):
    """The module's lookup as an autograd node: forward = ``tbe_forward``; backward = the fused update
    (no gradient returned for the weights) or, for OptimType.NONE and inference-only modules, the sparse
    gradient. The per-sample weights get their gradient whenever they require it."""

    @staticmethod
    def forward(ctx, module, indices, offsets, weights, per_sample_weights):
        ctx.module = module
        ctx.save_for_backward(indices, offsets, per_sample_weights)
        return torch.ops.hipdlrm.tbe_forward(weights, module.weights_offsets, module.D_offsets,
                                             module.rows_per_table, module.total_D, module.max_D, indices, offsets,
                                             int(module.pooling_mode), per_sample_weights, module.output_dtype)

    @staticmethod
    def backward(ctx, grad_output):
        module = ctx.module
        indices, offsets, per_sample_weights = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        grad_weights = None
        if module.optimizer in (OptimType.EXACT_SGD, OptimType.EXACT_ROWWISE_ADAGRAD, OptimType.ADAM):
            grad_psw = apply_optimizer(module, grad_output, indices, offsets, per_sample_weights)
        else:
            element, values, grad_psw = torch.ops.hipdlrm.tbe_backward_sparse(
                grad_output, module.weights.detach(), module.weights_offsets, module.D_offsets,
                module.rows_per_table, module.row_offsets, module.total_rows, module.total_D, module.max_D, indices,
                offsets, int(module.pooling_mode), per_sample_weights)
            if ctx.needs_input_grad[3]:
                # Segments ascend by row, and tables by offset: the indices are sorted and unique.
                grad_weights = torch.sparse_coo_tensor(element.unsqueeze(0), values, (module.weights.numel(),),
                                                       check_invariants=False, is_coalesced=True)
        if not ctx.needs_input_grad[4]:
            grad_psw = None
        return None, None, None, grad_weights, grad_psw


def lookup(module: "TableBatchedEmbedding", indices: torch.Tensor, offsets: torch.Tensor,
           per_sample_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """The module's forward when a backward may follow (grad mode on, something requires grad)."""
    return TBELookupFunction.apply(module, indices, offsets, module.weights, per_sample_weights)
