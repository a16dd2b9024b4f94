// bounds_check_indices on the CPU: the reference implementation.
//
// FBGEMM's CPU algorithm (offsets repaired bag by bag, then each bag's indices checked), written over
// raw pointers. The GPU path reproduces its results exactly.
#include <ATen/Dispatch.h>

#include <algorithm>

#include "ops/bounds_check/bounds_check.h"

namespace hipdlrm {
namespace ops {
namespace bounds_check {
namespace {

template <typename index_t>
Report check_cpu(const std::int64_t* rows, const Layout& layout, index_t* idx, std::int64_t n, index_t* off,
                 Mode mode) {
  const std::int64_t nb = layout.total_bags;
  Report r{};
  r.first_index_pos = -1;
  r.first_index_table = -1;
  r.first_index_bag = -1;
  r.first_bad_bag = -1;
  r.last_offset_value = off[nb];
  const bool last_wrong = static_cast<std::int64_t>(off[nb]) != n;

  auto note_bad_bag = [&](std::int64_t g, std::int64_t s, std::int64_t e) {
    ++r.offset_repairs;
    if (r.first_bad_bag < 0) { r.first_bad_bag = g; r.first_bad_bag_start = s; r.first_bad_bag_end = e; }
  };
  auto invalid = [n](std::int64_t s, std::int64_t e) { return s < 0 || s > e || e > n; };

  if (mode == kernels::bounds_check::kFatal) {
    r.offset_repairs = last_wrong ? 1 : 0;
    for (std::int64_t g = 0; g < nb; ++g)
      if (invalid(off[g], off[g + 1])) note_bad_bag(g, off[g], off[g + 1]);
    if (r.offset_repairs != 0) return r;
  } else {
    if (last_wrong) { off[nb] = static_cast<index_t>(n); r.offset_repairs = 1; }
    for (std::int64_t g = 0; g < nb; ++g) {
      const std::int64_t s = off[g], e = off[g + 1];
      if (!invalid(s, e)) continue;
      note_bad_bag(g, s, e);
      const std::int64_t cs = std::clamp<std::int64_t>(s, 0, n);
      off[g] = static_cast<index_t>(cs);
      off[g + 1] = static_cast<index_t>(std::clamp<std::int64_t>(e, cs, n));
    }
  }

  for (std::int64_t t = 0; t < layout.num_tables; ++t) {
    const std::int64_t b0 = layout.b_offsets.empty() ? t * layout.batch_size : layout.b_offsets[t];
    const std::int64_t b1 = layout.b_offsets.empty() ? (t + 1) * layout.batch_size : layout.b_offsets[t + 1];
    for (std::int64_t g = b0; g < b1; ++g) {
      for (std::int64_t i = off[g]; i < static_cast<std::int64_t>(off[g + 1]); ++i) {
        const std::int64_t v = idx[i];
        if (v == -1 || (v >= 0 && v < rows[t])) continue;
        if (r.index_violations++ == 0) {
          r.first_index_pos = i;
          r.first_index_value = v;
          r.first_index_table = t;
          r.first_index_bag = g - b0;
          r.first_index_limit = rows[t];
        }
        if (mode != kernels::bounds_check::kFatal) idx[i] = 0;
      }
    }
  }
  return r;
}

void bounds_check_indices_cpu(const at::Tensor& rows_per_table, const at::Tensor& indices, const at::Tensor& offsets,
                              std::int64_t mode, const at::Tensor& warning, const c10::optional<at::Tensor>& weights,
                              const c10::optional<at::Tensor>& B_offsets, std::int64_t max_B) {
  const Layout layout = check_arguments(rows_per_table, indices, offsets, mode, warning, weights, B_offsets, max_B, true);
  check_rows_per_table_values(rows_per_table);
  const Mode m = static_cast<Mode>(mode);
  Report r;
  AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "bounds_check_indices_cpu", [&] {
    r = check_cpu<index_t>(rows_per_table.data_ptr<std::int64_t>(), layout, indices.data_ptr<index_t>(),
                           indices.numel(), offsets.data_ptr<index_t>(), m);
  });
  if (m == kernels::bounds_check::kWarning) warning.fill_(r.offset_repairs + r.index_violations);
  act_on_report(r, m, layout, indices.numel());
}

void bounds_check_indices_impl_cpu(const at::Tensor& rows_per_table, const at::Tensor& indices,
                                   const at::Tensor& offsets, std::int64_t mode, const at::Tensor& warning,
                                   const c10::optional<at::Tensor>& weights,
                                   const c10::optional<at::Tensor>& B_offsets, std::int64_t max_B,
                                   bool /*per_thread_atomics: a GPU-kernel choice*/) {
  bounds_check_indices_cpu(rows_per_table, indices, offsets, mode, warning, weights, B_offsets, max_B);
}

}  // namespace

TORCH_LIBRARY_IMPL(hipdlrm, CPU, m) {
  m.impl("bounds_check_indices", &bounds_check_indices_cpu);
  m.impl("_bounds_check_indices_impl", &bounds_check_indices_impl_cpu);
}

}  // namespace bounds_check
}  // namespace ops
}  // namespace hipdlrm
