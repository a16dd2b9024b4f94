// The composite implementations' chunks and padded rows (composite.h).
#include "ops/attention/composite.h"

#include <algorithm>

namespace hipdlrm {
namespace ops {
namespace attention {
namespace {

constexpr std::int64_t kChunkScores = std::int64_t{1} << 24;  // score elements per chunk (C H Pq Pk)

// How many samples a chunk of widths pq, pk holds (at least one); divided in turn, so nothing overflows.
std::int64_t samples_per_chunk(std::int64_t heads, std::int64_t pq, std::int64_t pk) {
  return std::max<std::int64_t>(1, kChunkScores / heads / pq / pk);
}

}  // namespace

std::vector<Chunk> plan_chunks(std::int64_t batch, std::int64_t heads, const std::vector<std::int64_t>& q_lengths,
                               const std::vector<std::int64_t>& kv_lengths, std::int64_t width_q,
                               std::int64_t width_kv, const at::Device& device) {
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  std::vector<Chunk> chunks;
  if (heads == 0) return chunks;
  if (q_lengths.empty()) {  // lengths not on the host: consecutive samples at the max widths
    if (width_q == 0 || width_kv == 0) return chunks;
    const std::int64_t per = samples_per_chunk(heads, width_q, width_kv);
    for (std::int64_t b = 0; b < batch; b += per)
      chunks.push_back({at::arange(b, std::min(batch, b + per), longs), width_q, width_kv});
    return chunks;
  }
  std::vector<std::int64_t> order;
  for (std::int64_t b = 0; b < batch; ++b)
    if (q_lengths[b] > 0 && kv_lengths[b] > 0) order.push_back(b);
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return q_lengths[a] != q_lengths[b] ? q_lengths[a] > q_lengths[b] : kv_lengths[a] > kv_lengths[b];
  });
  for (std::size_t first = 0; first < order.size();) {
    std::int64_t pq = q_lengths[order[first]];
    std::int64_t pk = kv_lengths[order[first]];
    std::size_t last = first + 1;
    for (; last < order.size(); ++last) {
      const std::int64_t wq = std::max(pq, q_lengths[order[last]]);
      const std::int64_t wk = std::max(pk, kv_lengths[order[last]]);
      if (static_cast<std::int64_t>(last - first + 1) > samples_per_chunk(heads, wq, wk)) break;
      pq = wq;
      pk = wk;
    }
    const std::vector<std::int64_t> ids(order.begin() + first, order.begin() + last);
    chunks.push_back({at::tensor(ids, at::TensorOptions().dtype(at::kLong)).to(device), pq, pk});
    first = last;
  }
  return chunks;
}

SampleRanges sample_ranges(const at::Tensor& offsets, std::int64_t count, std::int64_t rows, std::int64_t max_len) {
  const at::Tensor off = offsets.to(at::kLong);
  SampleRanges r;
  r.start = off.narrow(0, 0, count).clamp(0, rows);
  const at::Tensor end = at::maximum(off.narrow(0, 1, count).clamp(0, rows), r.start);
  r.length = (end - r.start).clamp_max(max_len);
  return r;
}

PaddedRows padded_rows(const at::Tensor& start, const at::Tensor& length, std::int64_t width, std::int64_t total) {
  PaddedRows r;
  r.count = start.size(0);
  r.width = width;
  const at::Tensor pos = at::arange(width, start.options()).view({1, width});
  const at::Tensor row = start.view({r.count, 1}) + pos;
  r.inside = pos < length.view({r.count, 1});
  r.rows = row.clamp_max(total - 1).view(-1);
  r.dest = at::where(r.inside, row, total).view(-1);
  return r;
}

at::Tensor gather_rows(const at::Tensor& t, const PaddedRows& r) {
  const at::Tensor x = t.index_select(0, r.rows).view({r.count, r.width, t.size(1), t.size(2)});
  return x.masked_fill_(r.inside.logical_not().view({r.count, r.width, 1, 1}), 0).transpose(1, 2);
}

void scatter_rows(at::Tensor& out, const at::Tensor& dest, const at::Tensor& x) {
  out.index_copy_(0, dest, x.transpose(1, 2).reshape({-1, x.size(1), x.size(3)}).to(out.scalar_type()));
}

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm
