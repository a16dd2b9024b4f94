"""The two models of the training example, each built two ways (docs/training.md, "Models").

``backend="hipdlrm"`` uses hipdlrm's operators: ``TableBatchedEmbedding`` (row-wise Adagrad fused into
the backward, bounds check on every forward), ``group_index_select`` and ``hstu_mha``.
``backend="torch"`` builds the same model from plain PyTorch parts: one ``nn.EmbeddingBag`` /
``nn.Embedding`` per table with sparse gradients and ``RowwiseAdagrad`` (the same update, written out),
``index_select``, and HSTU attention on padded tensors written with torch ops.
The DLRM also has ``backend="torchrec"`` (``--distributed torchrec``): its tables are a TorchRec
``EmbeddingBagCollection`` on the meta device, for ``DistributedModelParallel`` to shard onto hipdlrm's
kernels (``distributed.py`` fills them after sharding).

Both backends start from identical weights for a given seed: the dense layers are built on the CPU under
a seeded RNG in the same order, and every embedding table is filled by ``init_table`` from its own
seeded generator on the training device.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import hipdlrm

from .data import NUM_DENSE, DlrmBatch, HstuBatch, mix_seed

BACKENDS = ("hipdlrm", "torch")
DLRM_BACKENDS = BACKENDS + ("torchrec",)


@dataclass(frozen=True)
class DlrmConfig:
    rows: tuple            # rows of each of the 26 tables
    bag_sizes: tuple       # lookups per example of each feature
    dim: int               # embedding dim (and the bottom MLP's output)
    bottom_mlp: tuple      # hidden sizes of the bottom MLP (13 -> ... -> dim)
    top_mlp: tuple         # hidden sizes of the top MLP (interaction -> ... -> 1)


@dataclass(frozen=True)
class HstuConfig:
    num_items: int
    dim: int               # item embedding and residual stream width
    num_heads: int
    head_dim: int          # per-head dim of q, k, v (16, 32, 64, 128 or 256: hstu_mha's head dims)
    num_layers: int
    max_seq_len: int
    attn_dtype: torch.dtype


def init_table(table: torch.Tensor, bound: float, seed: int, index: int) -> None:
    """Fills one ``[rows, dim]`` table uniformly in [-bound, bound) from a generator seeded by (seed,
    index) on the table's device: the same values for a TBE view and an ``nn.EmbeddingBag`` weight."""
    g = torch.Generator(device=table.device).manual_seed(mix_seed(seed, 0x7AB1E, index))
    with torch.no_grad():
        table.uniform_(-bound, bound, generator=g)


def table_init_bound(rows: int) -> float:
    """The DLRM tables' init range: uniform in [-1/sqrt(rows), 1/sqrt(rows))."""
    return 1.0 / math.sqrt(rows)


def mlp(sizes: Sequence[int], final_relu: bool) -> nn.Sequential:
    layers: List[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2 or final_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _seeded_cpu_build(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """Builds a module on the CPU under torch's global RNG seeded with ``seed``, leaving the RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()


class RowwiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad for embedding tables with sparse gradients, written with plain torch ops.

    Per table row r touched in the step, with g the sum of its gradients (fp32):
    ``state[r] += mean(g^2)``, ``w[r] -= lr * g / (sqrt(state[r]) + eps)`` -- the update hipdlrm's
    EXACT_ROWWISE_ADAGRAD fuses into the TBE backward. Untouched rows do not change.

    ``capturable`` (as torch.optim's flag): the step reads nothing on the host, so that it can run inside a
    CUDA graph. ``coalesce()`` cannot (the number of distinct rows is read back to size its output), so the
    capturable step sorts the gradient's rows instead and keeps one entry per lookup: each lookup carries
    the sum over its row's lookups (a segment sum over the sorted rows) and writes its row's new state and
    weight with a plain indexed store, which every lookup of that row makes with the same value.
    """

    def __init__(self, params, lr: float, eps: float, capturable: bool = False) -> None:
        super().__init__(params, dict(lr=lr, eps=eps, capturable=capturable))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for w in group["params"]:
                if w.grad is None:
                    continue
                if not w.grad.is_sparse:
                    raise RuntimeError("RowwiseAdagrad expects sparse gradients (nn.EmbeddingBag(sparse=True))")
                state = self.state[w]
                if "sum" not in state:
                    # fp32 (or the weights' dtype when wider), as the TBE keeps its state
                    state["sum"] = torch.zeros(w.shape[0], dtype=torch.promote_types(w.dtype, torch.float32),
                                               device=w.device)
                update = self._capturable_update if group["capturable"] else self._update
                update(w, state["sum"], w.grad, group["lr"], group["eps"])

    @staticmethod
    def _update(w: torch.Tensor, acc: torch.Tensor, grad: torch.Tensor, lr: float, eps: float) -> None:
        grad = grad.coalesce()
        rows, values = grad.indices()[0], grad.values()
        acc.index_add_(0, rows, values.pow(2).mean(1))
        scale = acc.index_select(0, rows).sqrt_().add_(eps).reciprocal_().mul_(-lr)
        w.index_add_(0, rows, values * scale.unsqueeze(1))

    @staticmethod
    def _capturable_update(w: torch.Tensor, acc: torch.Tensor, grad: torch.Tensor, lr: float, eps: float) -> None:
        rows, values = grad._indices()[0], grad._values()
        rows, order = torch.sort(rows)
        starts = torch.ones_like(rows, dtype=torch.bool)
        starts[1:] = rows[1:] != rows[:-1]
        segment = torch.cumsum(starts, 0) - 1                      # each lookup's distinct row, 0, 1, ...
        sums = torch.zeros_like(values).index_add_(0, segment, values.index_select(0, order))
        g = sums.index_select(0, segment).to(acc.dtype)            # per lookup: its row's summed gradient
        new_acc = acc.index_select(0, rows) + g.pow(2).mean(1)
        acc.index_put_((rows,), new_acc)
        step = g * new_acc.sqrt().add_(eps).reciprocal_().mul_(-lr).unsqueeze(1)
        w.index_put_((rows,), w.index_select(0, rows) + step.to(w.dtype))


# The embedding part of each backend: a module with forward (the lookups), sparse_optimizer(lr, eps,
# capturable=False) (the tables' optimizer, None when it is fused into the backward; capturable: one that
# reads nothing on the host, for a CUDA graph) and tables() (one [rows, dim] tensor per table, sharing
# storage with the weights).


class _HipdlrmTables(nn.Module):
    """One TableBatchedEmbedding over every table, row-wise Adagrad fused into its backward."""

    def __init__(self, rows: Sequence[int], dim: int, feature_table_map: Optional[Sequence[int]],
                 pooling_mode: hipdlrm.PoolingMode, lr: float, eps: float, bounds_check_mode: hipdlrm.BoundsCheckMode,
                 device: torch.device, seed: int) -> None:
        super().__init__()
        # The module draws its stochastic-rounding seed from torch's global RNG: seed that from ours, so a
        # run is a function of --seed alone.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(mix_seed(seed, 0x5EED))
            self.tbe = hipdlrm.TableBatchedEmbedding(
                [(r, dim) for r in rows], feature_table_map=feature_table_map, pooling_mode=pooling_mode,
                bounds_check_mode=bounds_check_mode, device=device,
                optimizer=hipdlrm.OptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=eps)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.tbe(indices, offsets)

    def sparse_optimizer(self, lr: float, eps: float, capturable: bool = False) -> Optional[torch.optim.Optimizer]:
        return None

    def tables(self) -> List[torch.Tensor]:
        return self.tbe.split_embedding_weights()


class _TorchBagTables(nn.Module):
    """One ``nn.EmbeddingBag(mode="sum", sparse=True)`` per table, trained by RowwiseAdagrad."""

    def __init__(self, rows: Sequence[int], dim: int, device: torch.device) -> None:
        super().__init__()
        self.bags = nn.ModuleList(
            nn.EmbeddingBag.from_pretrained(torch.empty(r, dim, device=device), freeze=False, mode="sum", sparse=True)
            for r in rows)

    def sparse_optimizer(self, lr: float, eps: float, capturable: bool = False) -> Optional[torch.optim.Optimizer]:
        return RowwiseAdagrad([bag.weight for bag in self.bags], lr=lr, eps=eps, capturable=capturable)

    def tables(self) -> List[torch.Tensor]:
        return [bag.weight.detach() for bag in self.bags]

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor, lookups_per_feature: Sequence[int],
                batch_size: int) -> torch.Tensor:
        outs, start = [], 0
        for t, (bag, n) in enumerate(zip(self.bags, lookups_per_feature)):
            bag_offsets = offsets[t * batch_size:(t + 1) * batch_size] - start
            outs.append(bag(indices[start:start + n], bag_offsets))
            start += n
        return torch.cat(outs, dim=1)


class _TorchrecTables(nn.Module):
    """A TorchRec ``EmbeddingBagCollection`` (SUM pooling, table ``t{i}`` looked up by feature ``f{i}``) on
    the meta device: it holds no weights until ``DistributedModelParallel`` shards it, and its fused
    optimizer comes with the sharder's ``fused_params``."""

    def __init__(self, rows: Sequence[int], dim: int) -> None:
        super().__init__()
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
        self.keys = [f"f{t}" for t in range(len(rows))]
        self.ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=f"t{t}", embedding_dim=dim, num_embeddings=r, feature_names=[key],
                                       pooling=PoolingType.SUM)
                    for t, (r, key) in enumerate(zip(rows, self.keys))],
            device=torch.device("meta"))

    def sparse_optimizer(self, lr: float, eps: float, capturable: bool = False) -> Optional[torch.optim.Optimizer]:
        return None

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        from torchrec import KeyedJaggedTensor
        # TableBatchedEmbedding's table-major layout is a KJT's key-major one: feature t's bags are
        # offsets[t*B : (t+1)*B + 1].
        stride = (offsets.numel() - 1) // len(self.keys)
        kjt = KeyedJaggedTensor(keys=self.keys, values=indices, offsets=offsets, stride=stride)
        # The sharded collection's output keys are grouped by sharding, not in the tables' order.
        pooled = self.ebc(kjt).to_dict()
        return torch.cat([pooled[key] for key in self.keys], dim=1)


class _TorchItemTable(nn.Module):
    """``nn.Embedding(sparse=True)`` over the item table, trained by RowwiseAdagrad."""

    def __init__(self, num_items: int, dim: int, device: torch.device) -> None:
        super().__init__()
        self.emb = nn.Embedding.from_pretrained(torch.empty(num_items, dim, device=device), freeze=False, sparse=True)

    def sparse_optimizer(self, lr: float, eps: float, capturable: bool = False) -> Optional[torch.optim.Optimizer]:
        return RowwiseAdagrad([self.emb.weight], lr=lr, eps=eps, capturable=capturable)

    def tables(self) -> List[torch.Tensor]:
        return [self.emb.weight.detach()]

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.emb(indices)


class DLRM(nn.Module):
    """DLRM: bottom MLP on the dense features, 26 pooled (SUM) embedding lookups, pairwise dot-product
    interaction of the 27 vectors, top MLP on [bottom output, the 351 dots] -> one logit."""

    def __init__(self, cfg: DlrmConfig, backend: str, device: torch.device, seed: int, lr: float, eps: float,
                 bounds_check_mode: hipdlrm.BoundsCheckMode = hipdlrm.BoundsCheckMode.WARNING) -> None:
        super().__init__()
        if backend not in DLRM_BACKENDS:
            raise ValueError(f"backend must be one of {DLRM_BACKENDS}, got {backend!r}")
        self.cfg, self.backend = cfg, backend
        num_vectors = len(cfg.rows) + 1
        self.num_pairs = num_vectors * (num_vectors - 1) // 2

        def build():
            return nn.ModuleDict(dict(
                bottom=mlp([NUM_DENSE, *cfg.bottom_mlp, cfg.dim], final_relu=True),
                top=mlp([cfg.dim + self.num_pairs, *cfg.top_mlp, 1], final_relu=False)))

        dense = _seeded_cpu_build(seed, build).to(device)
        self.bottom, self.top = dense["bottom"], dense["top"]
        li, lj = torch.triu_indices(num_vectors, num_vectors, offset=1)
        self.register_buffer("pair_i", li.to(device), persistent=False)
        self.register_buffer("pair_j", lj.to(device), persistent=False)
        if backend == "hipdlrm":
            self.embeddings: nn.Module = _HipdlrmTables(cfg.rows, cfg.dim, None, hipdlrm.PoolingMode.SUM, lr, eps,
                                                        bounds_check_mode, device, seed)
        elif backend == "torchrec":
            # lr, eps and the bounds-check mode reach the sharded tables through the sharder's fused_params;
            # the shards are filled with these same values after sharding.
            self.embeddings = _TorchrecTables(cfg.rows, cfg.dim)
        else:
            self.embeddings = _TorchBagTables(cfg.rows, cfg.dim, device)
        if backend != "torchrec":
            for t, table in enumerate(self.embeddings.tables()):
                init_table(table, table_init_bound(cfg.rows[t]), seed, t)

    def dense_parameters(self) -> List[nn.Parameter]:
        return [*self.bottom.parameters(), *self.top.parameters()]

    def forward(self, batch: DlrmBatch) -> torch.Tensor:
        B, T, D = batch.num_examples, len(self.cfg.rows), self.cfg.dim
        x = self.bottom(batch.dense)
        if self.backend == "torch":
            pooled = self.embeddings(batch.indices, batch.offsets, batch.lookups_per_feature, B)
        else:
            pooled = self.embeddings(batch.indices, batch.offsets)
        z = torch.cat([x.unsqueeze(1), pooled.view(B, T, D)], dim=1)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.pair_i, self.pair_j]
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


def hstu_valid_mask(seq_offsets: torch.Tensor, num_targets: torch.Tensor, max_seq_len: int) -> torch.Tensor:
    """[B, N, N] bool: the causal HSTU mask with targets (hstu_mha's contract, no contextual prefix, no
    max_attn_len): with n the sequence length and m = n - num_targets, id(p) = min(p, m);
    valid(i, j) = i, j < n and (i == j or id(i) > id(j)). History rows see earlier history; targets see
    the whole history and themselves, not each other."""
    B, N = seq_offsets.numel() - 1, max_seq_len
    lengths = (seq_offsets[1:] - seq_offsets[:-1]).view(B, 1)
    pos = torch.arange(N, device=seq_offsets.device).view(1, N)
    ids = torch.minimum(pos, lengths - num_targets.view(B, 1))
    inside = pos < lengths
    valid = (ids.unsqueeze(2) > ids.unsqueeze(1)) | torch.eye(N, dtype=torch.bool, device=seq_offsets.device)
    return valid & inside.unsqueeze(2) & inside.unsqueeze(1)


def padded_hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: HstuBatch, alpha: float,
                          valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """HSTU attention the plain-PyTorch way: pad the jagged [L, H, d] tensors to [B, N, H, d], compute
    ``P = SiLU(alpha q k^T) / N`` masked by ``hstu_valid_mask`` and ``O = P v`` with batched matmuls, and
    gather the jagged rows back. Same inputs and output as ``hipdlrm.hstu_mha``. ``valid``: the batch's
    mask when the caller has it already (one per batch, shared by the layers)."""
    B, N = batch.seq_offsets.numel() - 1, batch.max_seq_len
    if valid is None:
        valid = hstu_valid_mask(batch.seq_offsets, batch.num_targets, N)
    where = (batch.token_user, batch.positions)

    def pad(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros((B, N) + tuple(x.shape[1:])).index_put(where, x)

    qp, kp, vp = (pad(x).transpose(1, 2) for x in (q, k, v))                  # [B, H, N, d]
    scores = torch.matmul(qp, kp.transpose(2, 3)) * alpha                      # [B, H, N, N]
    p = (F.silu(scores) / N).masked_fill(~valid.unsqueeze(1), 0)
    out = torch.matmul(p, vp).transpose(1, 2)                                  # [B, N, H, d]
    return out[where]


class HSTULayer(nn.Module):
    """One HSTU block (Zhai et al., 2024): u, v, q, k = SiLU(Linear(LayerNorm(x))); a = attention(q, k, v);
    x + Linear(LayerNorm(a) * u)."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        width = num_heads * head_dim
        self.norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * width)
        self.attn_norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, dim)

    def forward(self, x: torch.Tensor, attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                dtype: torch.dtype) -> torch.Tensor:
        L, H, d = x.shape[0], self.num_heads, self.head_dim
        u, v, q, k = F.silu(self.uvqk(self.norm(x))).split(H * d, dim=1)
        q, k, v = (t.reshape(L, H, d).to(dtype).contiguous() for t in (q, k, v))
        a = attention(q, k, v).reshape(L, H * d).to(x.dtype)
        return x + self.out(self.attn_norm(a) * u)


class HSTU(nn.Module):
    """A sequential recommender: item embeddings (lookup output rows of the history and candidate items)
    gathered into one jagged sequence per user (history, then candidates) plus a learned position
    embedding, a stack of HSTU layers (causal, the candidates as targets), and an MLP head on
    [the candidate's output token, the candidate's item embedding] -> one logit per candidate."""

    def __init__(self, cfg: HstuConfig, backend: str, device: torch.device, seed: int, lr: float, eps: float,
                 bounds_check_mode: hipdlrm.BoundsCheckMode = hipdlrm.BoundsCheckMode.WARNING) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.cfg, self.backend = cfg, backend
        self.alpha = 1.0 / math.sqrt(cfg.head_dim)

        def build():
            return nn.ModuleDict(dict(
                layers=nn.ModuleList(HSTULayer(cfg.dim, cfg.num_heads, cfg.head_dim) for _ in range(cfg.num_layers)),
                final_norm=nn.LayerNorm(cfg.dim),
                head=mlp([2 * cfg.dim, cfg.dim, 1], final_relu=False)))

        dense = _seeded_cpu_build(seed, build).to(device)
        self.layers, self.final_norm, self.head = dense["layers"], dense["final_norm"], dense["head"]
        g = torch.Generator().manual_seed(mix_seed(seed, 0x9051))
        self.positions = nn.Parameter((torch.randn(cfg.max_seq_len, cfg.dim, generator=g) * 0.02).to(device))
        if backend == "hipdlrm":
            self.embeddings: nn.Module = _HipdlrmTables([cfg.num_items], cfg.dim, [0, 0], hipdlrm.PoolingMode.NONE,
                                                        lr, eps, bounds_check_mode, device, seed)
        else:
            self.embeddings = _TorchItemTable(cfg.num_items, cfg.dim, device)
        init_table(self.embeddings.tables()[0], 0.05, seed, 0)

    def dense_parameters(self) -> List[nn.Parameter]:
        return [*self.layers.parameters(), *self.final_norm.parameters(), *self.head.parameters(), self.positions]

    def forward(self, batch: HstuBatch) -> torch.Tensor:
        if self.backend == "hipdlrm":
            rows = self.embeddings(batch.indices, batch.offsets)
            item_x, pos_x = hipdlrm.group_index_select([rows, self.positions], [batch.src_rows, batch.positions])

            def attention(q, k, v):
                return hipdlrm.hstu_mha(batch.max_seq_len, self.alpha, q, k, v, batch.seq_offsets, causal=True,
                                        num_targets=batch.num_targets)
        else:
            rows = self.embeddings(batch.indices)
            item_x, pos_x = rows.index_select(0, batch.src_rows), self.positions.index_select(0, batch.positions)
            valid = hstu_valid_mask(batch.seq_offsets, batch.num_targets, batch.max_seq_len)

            def attention(q, k, v):
                return padded_hstu_attention(q, k, v, batch, self.alpha, valid)

        x = item_x + pos_x
        for layer in self.layers:
            x = layer(x, attention, self.cfg.attn_dtype)
        x = self.final_norm(x)
        if self.backend == "hipdlrm":
            h, e = hipdlrm.group_index_select([x, rows], [batch.target_rows, batch.cand_rows])
        else:
            h, e = x.index_select(0, batch.target_rows), rows.index_select(0, batch.cand_rows)
        return self.head(torch.cat([h, e], dim=1)).squeeze(1)
