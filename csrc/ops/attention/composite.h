// The pieces of the attention ops' composite implementations (attention.cpp, gdpa.cpp) that do not depend on
// the op: chunks of samples padded to a common width, the samples' rows clamped as the kernels clamp them,
// and the gathers and scatters of padded rows.
//
// Samples go in chunks, each padded to a query width Pq and a key width Pk ([C, H, Pq, Pk] scores per
// chunk, padded positions masked out). Where the lengths are on the host (the CPU path, whose checks read
// the offsets) the samples are sorted by length and each chunk is padded to its longest, so a jagged batch
// costs about its own sum of nq nk; where they are not (a GPU: nothing is read on the host, so the path
// stays graph-capturable and never stalls the stream) the chunks are consecutive samples padded to the max
// lengths, and every sequence is clamped into its tensor's rows and its max length exactly as the kernels'
// sample_rows (attention_core.h) clamps it, so that invalid offsets (recorded on the device by
// validate_offsets) cost a wrong result, never an access out of bounds.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace hipdlrm {
namespace ops {
namespace attention {

struct Chunk {
  at::Tensor samples;         // [C] long, on the device
  std::int64_t width_q = 0;   // Pq
  std::int64_t width_kv = 0;  // Pk
};

// The chunks of `batch` samples for scores of `heads` heads. q_lengths, kv_lengths: each sample's lengths
// where they were read on the host (B entries each; the samples with no query or no key are left out), or
// both empty: then consecutive samples, all of them, at widths width_q and width_kv (the max lengths, no
// larger than the rows, which bound every clamped sequence).
std::vector<Chunk> plan_chunks(std::int64_t batch, std::int64_t heads, const std::vector<std::int64_t>& q_lengths,
                               const std::vector<std::int64_t>& kv_lengths, std::int64_t width_q,
                               std::int64_t width_kv, const at::Device& device);

// Each sample's first row and length, [B] long on the offsets' device.
struct SampleRanges {
  at::Tensor start, length;
};

// Sequences b < count of `offsets` ([count + 1] int32/int64) in a tensor of `rows` rows, clamped as
// sample_rows clamps them: the start into [0, rows], the end into [start, rows], the length to max_len.
SampleRanges sample_ranges(const at::Tensor& offsets, std::int64_t count, std::int64_t rows, std::int64_t max_len);

// The padded positions of a chunk's sequences (starts and lengths [C] long, width P) in a tensor of
// `total` >= 1 rows.
struct PaddedRows {
  std::int64_t count = 0, width = 0;
  at::Tensor rows;    // [C * P] long: the row each position reads (clamped into [0, total))
  at::Tensor dest;    // [C * P] long: the row it writes: rows inside the sequence, `total` (a spare row) elsewhere
  at::Tensor inside;  // [C, P] bool: the position is inside its sequence
};

PaddedRows padded_rows(const at::Tensor& start, const at::Tensor& length, std::int64_t width, std::int64_t total);

// [C, H, P, D]: rows r.rows of t ([total, H, D]), heads second; zeros at the padded positions, so that no
// value of another sequence (an inf, a NaN) reaches this one's products.
at::Tensor gather_rows(const at::Tensor& t, const PaddedRows& r);

// x [C, H, P, D] -> rows `dest` of out ([total + 1, H, D]; row `total` takes the padded positions).
void scatter_rows(at::Tensor& out, const at::Tensor& dest, const at::Tensor& x);

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm
