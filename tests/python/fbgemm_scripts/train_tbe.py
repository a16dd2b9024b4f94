"""A small DLRM-style training loop written against FBGEMM's SplitTableBatchedEmbeddingBagsCodegen.

It is kept as FBGEMM's users write it: the one import below is the only line that names the library
(test_fbgemm_compat.py runs this file as it is, then with that line pointing at fbgemm_gpu's training
module, and compares the two runs). Three embedding tables of mixed dims pooled with SUM, one weighted
feature, the row-wise Adagrad update fused into the backward, a learning-rate warm-up through
set_learning_rate, and a checkpoint (state_dict) restored into a freshly built module half-way. The
batches are drawn on the CPU and moved, so `--device cuda` trains on the same data.

    python train_tbe.py --out result.pt [--device cuda]
"""
import argparse
import io

import torch
from hipdlrm.fbgemm import (
    ComputeDevice, EmbeddingLocation, OptimType, PoolingMode, SparseType, SplitTableBatchedEmbeddingBagsCodegen)

TABLES = [(1000, 16), (500, 8), (200, 16)]
BATCH = 32
STEPS = 40
WARMUP = 10
EMB_LR = 0.5
DENSE_LR = 0.5


def build_embeddings(device):
    location, compute = ((EmbeddingLocation.DEVICE, ComputeDevice.CUDA) if device.type == "cuda"
                         else (EmbeddingLocation.HOST, ComputeDevice.CPU))
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, location, compute) for rows, dim in TABLES],
        optimizer=OptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=EMB_LR,
        eps=1e-8,
        weights_precision=SparseType.FP32,
        output_dtype=SparseType.FP32,
        pooling_mode=PoolingMode.SUM,
    )


def batch(gen, teacher):
    """Bags of 1-5 ids per (feature, sample), feature-major as the TBE expects; the last feature is weighted;
    the label is the sign of a fixed random score of the ids, so there is something to learn."""
    lengths = torch.randint(1, 6, (len(TABLES) * BATCH,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    indices = torch.cat([torch.randint(0, TABLES[i // BATCH][0], (int(n),), generator=gen)
                         for i, n in enumerate(lengths.tolist())])
    weights = torch.ones(indices.numel())
    last = int(offsets[(len(TABLES) - 1) * BATCH])
    weights[last:] = torch.rand(indices.numel() - last, generator=gen) + 0.5
    score = torch.zeros(BATCH)
    for f in range(len(TABLES)):
        for b in range(BATCH):
            s, e = int(offsets[f * BATCH + b]), int(offsets[f * BATCH + b + 1])
            score[b] += (teacher[f][indices[s:e]] * weights[s:e]).sum()
    return indices, offsets, weights, (score > 0).float()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    device = torch.device(args.device)

    emb = build_embeddings(device)
    # Initial weights drawn on the CPU after construction (so they depend neither on what it drew nor on
    # the device) and copied in.
    torch.manual_seed(0)
    for table, (rows, dim) in zip(emb.split_embedding_weights(), TABLES):
        table.data.copy_(torch.empty(rows, dim).uniform_(-0.1, 0.1))
    total_dim = sum(dim for _, dim in TABLES)
    top = torch.nn.Sequential(torch.nn.Linear(total_dim, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(device)
    dense_opt = torch.optim.SGD(top.parameters(), lr=DENSE_LR)

    gen = torch.Generator().manual_seed(1)
    teacher = [torch.randn(rows, generator=gen) for rows, _ in TABLES]
    losses = []
    for step in range(STEPS):
        if step == STEPS // 2:  # checkpoint and restore into a new module, as a restarted job would
            buffer = io.BytesIO()
            torch.save(emb.state_dict(), buffer)
            buffer.seek(0)
            emb = build_embeddings(device)
            emb.load_state_dict(torch.load(buffer))
        emb.set_learning_rate(EMB_LR * min(1.0, (step + 1) / WARMUP))
        indices, offsets, weights, labels = (t.to(device) for t in batch(gen, teacher))
        pooled = emb(indices, offsets, per_sample_weights=weights)
        logits = top(pooled).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        dense_opt.zero_grad()
        loss.backward()  # also applies the row-wise Adagrad step to the looked-up rows
        dense_opt.step()
        losses.append(float(loss.detach()))
        if step % 10 == 0 or step == STEPS - 1:
            print(f"step {step:3d} loss {losses[-1]:.5f} lr {emb.get_learning_rate():.5f}")

    torch.save({
        "losses": losses,
        "learning_rate": emb.get_learning_rate(),
        "tables": [t.detach().cpu().clone() for t in emb.split_embedding_weights()],
        "states": [[s.detach().cpu().clone() for s in table] for table in emb.split_optimizer_states()],
    }, args.out)


if __name__ == "__main__":
    main()
