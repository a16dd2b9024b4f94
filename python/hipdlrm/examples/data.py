"""Synthetic, seeded training data with a learnable signal (docs/training.md, "Data").

Every batch is a pure function of (seed, step, sizes, device): the hipdlrm model and the plain-PyTorch
model of a ``--baseline torch`` run see the same batches, and a resumed run sees exactly the batches the
uninterrupted run would have seen. Batches are generated on the training device.

The labels follow a hidden rule the model can learn, so the loss falls measurably:

- DLRM: ``logit = 1.5 * dense . w / |w| + 1.5 * sum over lookups of score(table, row) / sqrt(lookups / 3)``,
  ``label ~ Bernoulli(sigmoid(logit))``, where ``score`` is a fixed pseudo-random value in [-1, 1) per
  (table, row) from an integer hash. Both terms have unit variance; the model learns the dense term through
  the bottom MLP and the row scores through the embedding rows (rows are Zipf-distributed, so hot rows
  are seen often).
- HSTU: every user has a preferred item cluster (``cluster(item) = item % 16``); 70% of the history is
  drawn from it, and each candidate comes from it with probability 1/2.
  ``label ~ Bernoulli(sigmoid(1.5 * (+1 if the candidate is in the preferred cluster else -1) + 2.5 *
  score(item)))``: the score term is learned through the candidate's embedding row (as in DLRM), the
  cluster term only by reading the user's preference from the history through attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence

import torch

# DLRM-v2 (MLPerf Training, Criteo 1TB multi-hot): bag size of each of the 26 sparse features.
MLPERF_BAG_SIZES = (3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1)
# Criteo 1TB cardinalities as MLPerf caps them (40M): the base of the table sizes.
CRITEO_TB_ROWS = (40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10, 2209,
                  11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36)
NUM_DENSE = 13
HSTU_CLUSTERS = 16
CLUSTER_WEIGHT = 1.5
SCORE_WEIGHT = 2.5

_MASK32 = 0xFFFFFFFF


def table_rows(rows_scale: float, min_rows: int = 1_000_000, max_rows: int = 10_000_000) -> List[int]:
    """Rows of the 26 DLRM tables: Criteo 1TB's cardinalities clamped into [min_rows, max_rows] (1M-10M,
    73.1M rows in all), times ``rows_scale``, at least 2."""
    return [max(2, round(min(max(r, min_rows), max_rows) * rows_scale)) for r in CRITEO_TB_ROWS]


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from several integers (different (seed, step) pairs give unrelated streams)."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0x100000001B3 + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 29
    return h & 0x7FFFFFFFFFFFFFFF


def _generator(device: torch.device, *parts: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(mix_seed(*parts))


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of int64 keys in [0, 2^32); every product stays below 2^63."""
    x = (x * 0x5BD1E995) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    x = x ^ (x >> 12)
    x = (x * 0x297A2D39) & _MASK32
    return x ^ (x >> 15)


def hidden_score(key: torch.Tensor) -> torch.Tensor:
    """A fixed pseudo-random value in [-1, 1) per int64 key (float32)."""
    return ((hash32(key & _MASK32) >> 8).to(torch.float32) * (1.0 / (1 << 23))) - 1.0


def zipf_rows(num_rows: torch.Tensor, alpha: float, generator: torch.Generator) -> torch.Tensor:
    """One row per entry of ``num_rows`` (int64, the table size of each draw), Zipf-like over the ranks and
    scattered over the table.

    rank = floor(x) - 1 with x drawn from the power law ``x^-alpha`` on [1, rows + 1) (inverse CDF), so
    P(rank k) is the law's mass on [k + 1, k + 2), about (k + 1.5)^-alpha. The row is
    ``rank * (2^31 - 1) mod rows``, a bijection (2^31 - 1 is prime), so hot rows are spread over the table.
    """
    n = num_rows.to(torch.float64)
    u = torch.rand(num_rows.shape, generator=generator, device=num_rows.device, dtype=torch.float64)
    if abs(alpha - 1.0) < 1e-9:
        x = torch.exp(u * torch.log1p(n))
    else:
        a = 1.0 - alpha
        x = (u * (torch.pow(n + 1.0, a) - 1.0) + 1.0).pow(1.0 / a)
    rank = torch.minimum(x.floor().to(torch.int64) - 1, num_rows - 1).clamp_(min=0)
    return (rank * 2147483647) % num_rows


@dataclass
class DlrmBatch:
    """One DLRM batch. ``indices`` / ``offsets`` are in TableBatchedEmbedding's table-major layout
    (feature t's bags are ``offsets[t*B : (t+1)*B + 1]``); ``lookups_per_feature`` are the host-side sizes
    of each feature's slice of ``indices`` (so the per-table baseline needs no host synchronisation)."""

    dense: torch.Tensor
    indices: torch.Tensor
    offsets: torch.Tensor
    labels: torch.Tensor
    lookups_per_feature: List[int]

    @property
    def num_examples(self) -> int:
        return self.labels.numel()


class DlrmData:
    """Batches for ``--model dlrm``: 13 dense features, 26 sparse features with fixed bag sizes."""

    def __init__(self, rows: Sequence[int], bag_sizes: Sequence[int], batch_size: int, zipf_alpha: float,
                 seed: int, device: torch.device) -> None:
        if len(rows) != len(bag_sizes):
            raise ValueError(f"{len(rows)} tables but {len(bag_sizes)} bag sizes")
        self.rows, self.bag_sizes = list(rows), list(bag_sizes)
        self.batch_size, self.zipf_alpha, self.seed, self.device = batch_size, zipf_alpha, seed, device
        B = batch_size
        self.lookups_per_feature = [B * L for L in self.bag_sizes]
        lengths = torch.tensor([L for L in self.bag_sizes for _ in range(B)], dtype=torch.int64)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(device)
        self.table_of_lookup = torch.repeat_interleave(
            torch.arange(len(rows)), torch.tensor(self.lookups_per_feature)).to(device)
        self.rows_of_lookup = torch.tensor(self.rows, dtype=torch.int64, device=device)[self.table_of_lookup]
        self.example_of_lookup = torch.cat(
            [torch.arange(B).repeat_interleave(L) for L in self.bag_sizes]).to(device)
        g = _generator(torch.device("cpu"), seed, 0xD15E)
        w = torch.randn(NUM_DENSE, generator=g)
        self.dense_weight = (w / w.norm()).to(device)
        self.sparse_norm = 1.0 / math.sqrt(sum(self.bag_sizes) / 3.0)

    def batch(self, step: int) -> DlrmBatch:
        g = _generator(self.device, self.seed, step)
        B = self.batch_size
        dense = torch.randn(B, NUM_DENSE, generator=g, device=self.device)
        indices = zipf_rows(self.rows_of_lookup, self.zipf_alpha, g)
        score = hidden_score(indices * len(self.rows) + self.table_of_lookup)
        sparse_term = torch.zeros(B, device=self.device).index_add_(0, self.example_of_lookup, score)
        logit = 1.5 * (dense @ self.dense_weight) + 1.5 * self.sparse_norm * sparse_term
        labels = (torch.rand(B, generator=g, device=self.device) < torch.sigmoid(logit)).to(torch.float32)
        return DlrmBatch(dense, indices, self.offsets.clone(), labels, self.lookups_per_feature)


@dataclass
class HstuBatch:
    """One HSTU batch: B users, each a jagged sequence of history items followed by ``num_targets``
    candidates (the targets of ``hstu_mha``).

    ``indices`` / ``offsets``: the lookup input in TableBatchedEmbedding's layout with two features
    (feature 0: every user's history, feature 1: every user's candidates), both on the item table.
    ``src_rows[i]``: the lookup-output row of sequence token i; ``positions[i]``: its position in its
    sequence; ``token_user[i]``: its user. ``target_rows``: the sequence token of each candidate (user
    major); ``cand_rows``: the lookup-output row of each candidate; ``labels``: one per candidate.
    """

    indices: torch.Tensor
    offsets: torch.Tensor
    seq_offsets: torch.Tensor
    num_targets: torch.Tensor
    src_rows: torch.Tensor
    positions: torch.Tensor
    token_user: torch.Tensor
    target_rows: torch.Tensor
    cand_rows: torch.Tensor
    labels: torch.Tensor
    max_seq_len: int
    padding: int = 0  # trailing padding tokens (HstuBuckets.pad), after the B users' sequences
    users: int = -1   # B; -1: every sequence is a user's (an unpadded batch)

    @property
    def num_examples(self) -> int:
        return self.users if self.users >= 0 else self.num_targets.numel()

    @property
    def num_tokens(self) -> int:
        """The users' tokens (padding excluded)."""
        return self.src_rows.numel() - self.padding


class HstuBuckets:
    """Fixed shapes for HSTU batches, which a captured CUDA graph needs (``--cuda-graph``).

    A batch's token count L is rounded up to the capacity of its bucket. A batch sums ``batch_size``
    independent history lengths, so its token count lies close to the mean: ``buckets`` capacities
    evenly spaced over the mean +- 3 standard deviations of that sum (clipped to the fewest and most
    tokens a batch can have), with its lower end as bucket 0 and one more bucket of the most tokens
    (``batch_size * max_seq_len``) for the rare batch beyond. The tokens in excess become padding: one
    lookup each (of row 0), gathered into extra sequences of at most ``pad_len`` tokens (as many as the
    bucket can need), with no targets, placed after the users' sequences (so every user token,
    candidate and label keeps its row). The padding sequences attend only to themselves, feed no loss
    and get exactly zero gradients: a padded batch trains the model as the batch does (up to the
    rounding of reductions over more rows), and the fused optimizer leaves row 0 unchanged by the
    padding lookups (a zero gradient row is no update for the optimizers without weight decay that the
    example uses).

    A padded batch's tensors' shapes depend only on its bucket: one graph per bucket replays any batch
    of that bucket, and a bucket's graph is captured when its first batch comes.
    """

    def __init__(self, data: "HstuData", buckets: int = 8, pad_len: int = 64) -> None:
        if buckets < 1:
            raise ValueError(f"buckets must be >= 1, got {buckets}")
        B, C = data.batch_size, data.num_targets
        self.fewest = B * (data.min_history + C)
        self.most = B * data.max_seq_len
        n = data.max_history - data.min_history + 1  # history lengths: uniform integers over n values
        mean = B * ((data.min_history + data.max_history) / 2 + C)
        sd = math.sqrt(B * (n * n - 1) / 12)
        self.lo = max(self.fewest, math.floor(mean - 3 * sd))
        hi = min(self.most, math.ceil(mean + 3 * sd))
        self.width = max(1, math.ceil((hi - self.lo) / buckets))
        self.count = min(buckets, math.ceil((self.most - self.lo) / self.width))  # the spaced buckets 1..count
        self.pad_len = max(1, min(pad_len, data.max_seq_len))

    def bucket(self, tokens: int) -> int:
        """The bucket of a batch of ``tokens`` tokens: 0 (up to the lowest capacity) .. count + 1 (the most)."""
        if not self.fewest <= tokens <= self.most:
            raise ValueError(f"a batch of {tokens} tokens is outside [{self.fewest}, {self.most}], the token counts "
                             "its data can have")
        k = max(0, math.ceil((tokens - self.lo) / self.width))
        return k if k <= self.count else self.count + 1

    def capacity(self, bucket: int) -> int:
        return self.most if bucket > self.count else min(self.most, self.lo + bucket * self.width)

    def pad_sequences(self, bucket: int) -> int:
        """The padding sequences of a bucket's batches: enough for its largest padding."""
        below = self.fewest if bucket == 0 else self.capacity(bucket - 1) + 1
        return math.ceil((self.capacity(bucket) - below) / self.pad_len)

    def pad(self, batch: HstuBatch) -> tuple:
        """(bucket, the batch padded to the bucket's capacity)."""
        L = batch.src_rows.numel()
        k = self.bucket(L)
        P = self.capacity(k) - L
        B = batch.num_targets.numel()
        dev = batch.indices.device
        i64 = dict(dtype=torch.int64, device=dev)
        # pad_len tokens per padding sequence, the rest in the last one used, the others empty; built on
        # the device from shapes only (no copy from the host, no sync)
        S = self.pad_sequences(k)
        ends = (torch.arange(1, S + 1, **i64) * self.pad_len).clamp_(max=P)
        pad_offsets = ends + batch.seq_offsets[-1]
        pad_tokens = torch.arange(P, **i64)
        padded = HstuBatch(
            indices=torch.cat([batch.indices, torch.zeros(P, **i64)]),
            offsets=torch.cat([batch.offsets[:-1], batch.offsets[-1:] + P]),
            seq_offsets=torch.cat([batch.seq_offsets, pad_offsets]),
            num_targets=torch.cat([batch.num_targets, torch.zeros(S, **i64)]),
            src_rows=torch.cat([batch.src_rows, L + pad_tokens]),
            positions=torch.cat([batch.positions, pad_tokens % self.pad_len]),
            token_user=torch.cat([batch.token_user, B + pad_tokens // self.pad_len]),
            target_rows=batch.target_rows, cand_rows=batch.cand_rows, labels=batch.labels,
            max_seq_len=batch.max_seq_len, padding=P, users=B)
        return k, padded


class HstuData:
    """Batches for ``--model hstu``: history lengths uniform in [min_history_frac, 1] x (max_seq_len -
    num_targets), items Zipf-distributed within their cluster."""

    def __init__(self, num_items: int, max_seq_len: int, num_targets: int, batch_size: int,
                 min_history_frac: float, zipf_alpha: float, seed: int, device: torch.device) -> None:
        if num_items < HSTU_CLUSTERS:
            raise ValueError(f"num_items must be at least {HSTU_CLUSTERS}, got {num_items}")
        if num_targets >= max_seq_len:
            raise ValueError(f"num_targets ({num_targets}) must be smaller than max_seq_len ({max_seq_len})")
        self.num_items, self.max_seq_len, self.num_targets = num_items, max_seq_len, num_targets
        self.batch_size, self.zipf_alpha, self.seed, self.device = batch_size, zipf_alpha, seed, device
        self.max_history = max_seq_len - num_targets
        self.min_history = min(self.max_history, max(1, math.ceil(min_history_frac * self.max_history)))
        self.items_per_cluster = num_items // HSTU_CLUSTERS

    def _items(self, clusters: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        per_cluster = torch.full_like(clusters, self.items_per_cluster)
        return zipf_rows(per_cluster, self.zipf_alpha, g) * HSTU_CLUSTERS + clusters

    def batch(self, step: int) -> HstuBatch:
        g = _generator(self.device, self.seed, step)
        dev, B, C, K = self.device, self.batch_size, self.num_targets, HSTU_CLUSTERS
        i64 = dict(dtype=torch.int64, device=dev)
        hist_len = torch.randint(self.min_history, self.max_history + 1, (B,), generator=g, **i64)
        preferred = torch.randint(0, K, (B,), generator=g, **i64)
        num_hist = int(hist_len.sum())
        zero = torch.zeros(1, **i64)
        hist_offsets = torch.cat([zero, hist_len.cumsum(0)])
        users = torch.arange(B, **i64)

        hist_user = users.repeat_interleave(hist_len, output_size=num_hist)
        from_pref = torch.rand(num_hist, generator=g, device=dev) < 0.7
        hist_clusters = torch.where(from_pref, preferred[hist_user],
                                    torch.randint(0, K, (num_hist,), generator=g, **i64))
        hist_items = self._items(hist_clusters, g)

        cand_user = users.repeat_interleave(C)
        from_pref = torch.rand(B * C, generator=g, device=dev) < 0.5
        cand_items = self._items(torch.where(from_pref, preferred[cand_user],
                                             torch.randint(0, K, (B * C,), generator=g, **i64)), g)
        match = (cand_items % K == preferred[cand_user]).to(torch.float32)
        logit = CLUSTER_WEIGHT * (2.0 * match - 1.0) + SCORE_WEIGHT * hidden_score(cand_items)
        labels = (torch.rand(B * C, generator=g, device=dev) < torch.sigmoid(logit)).to(torch.float32)

        indices = torch.cat([hist_items, cand_items])
        offsets = torch.cat([hist_offsets, num_hist + torch.arange(1, B + 1, **i64) * C])
        seq_len = hist_len + C
        seq_offsets = torch.cat([zero, seq_len.cumsum(0)])
        num_tokens = num_hist + B * C
        token_user = users.repeat_interleave(seq_len, output_size=num_tokens)
        positions = torch.arange(num_tokens, **i64) - seq_offsets[token_user]
        user_hist = hist_len[token_user]
        src_rows = torch.where(positions < user_hist, hist_offsets[token_user] + positions,
                               num_hist + token_user * C + positions - user_hist)
        target_rows = (seq_offsets[:-1] + hist_len).repeat_interleave(C) + torch.arange(C, **i64).repeat(B)
        cand_rows = num_hist + torch.arange(B * C, **i64)
        return HstuBatch(indices, offsets, seq_offsets, torch.full((B,), C, **i64), src_rows, positions, token_user,
                         target_rows, cand_rows, labels, self.max_seq_len)
