// bounds_check_indices: schema, argument checks, reporting, and the CPU implementation.
//
// The CPU implementation is the reference: FBGEMM's CPU algorithm (offsets repaired bag by bag, then
// each bag's indices checked), written over raw pointers. The GPU path reproduces its results exactly.
#include "bounds_check.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace hipdlrm {
namespace ops {
namespace bounds_check {
namespace {

std::atomic<void (*)()> g_flush_hook{nullptr};

void flush_pending() {
  if (auto hook = g_flush_hook.load()) hook();
}

bool quiet() {
  const char* q = std::getenv("HIPDLRM_QUIET_WARNINGS");
  return q != nullptr && q[0] != '\0' && q[0] != '0';
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& indices) {
  TORCH_CHECK(t.device() == indices.device(), "bounds_check_indices: ", name, " is on ", t.device(),
              " but indices is on ", indices.device(), "; all tensors must be on one device");
}

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
  const Layout layout = check_arguments(rows_per_table, indices, offsets, mode, warning, weights, B_offsets, max_B);
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

void set_flush_hook(void (*hook)()) { g_flush_hook.store(hook); }

void define(torch::Library& m) {
  m.def(
      "bounds_check_indices(Tensor rows_per_table, Tensor(a!) indices, Tensor(b!) offsets, int bounds_check_mode, "
      "Tensor(c!) warning, Tensor(d!)? weights=None, Tensor? B_offsets=None, SymInt max_B=-1) -> ()");
  // The same op with the kernel's counting strategy exposed, for the benchmark's ablation.
  m.def(
      "_bounds_check_indices_impl(Tensor rows_per_table, Tensor(a!) indices, Tensor(b!) offsets, "
      "int bounds_check_mode, Tensor(c!) warning, Tensor(d!)? weights, Tensor? B_offsets, SymInt max_B, "
      "bool per_thread_atomics) -> ()");
  m.def("_flush_bounds_check_warnings() -> ()", &flush_pending);
}

Layout check_arguments(const at::Tensor& rows_per_table, const at::Tensor& indices, const at::Tensor& offsets,
                       std::int64_t mode, const at::Tensor& warning, const c10::optional<at::Tensor>& weights,
                       const c10::optional<at::Tensor>& B_offsets, std::int64_t max_B) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "bounds_check_indices: bounds_check_mode must be 0 (FATAL), 1 (WARNING) or ",
              "2 (IGNORE), got ", mode);
  TORCH_CHECK(indices.dim() == 1, "bounds_check_indices: indices must be 1-D, got shape ", indices.sizes());
  TORCH_CHECK(indices.scalar_type() == at::kInt || indices.scalar_type() == at::kLong,
              "bounds_check_indices: indices must be int32 or int64, got ", indices.scalar_type());
  TORCH_CHECK(indices.is_contiguous(), "bounds_check_indices: indices must be contiguous (it is repaired in place)");
  TORCH_CHECK(offsets.dim() == 1, "bounds_check_indices: offsets must be 1-D, got shape ", offsets.sizes());
  TORCH_CHECK(offsets.scalar_type() == indices.scalar_type(), "bounds_check_indices: offsets must have the dtype of ",
              "indices (", indices.scalar_type(), "), got ", offsets.scalar_type());
  TORCH_CHECK(offsets.is_contiguous(), "bounds_check_indices: offsets must be contiguous (it is repaired in place)");
  TORCH_CHECK(offsets.numel() >= 1, "bounds_check_indices: offsets must have at least one entry");
  TORCH_CHECK(rows_per_table.dim() == 1 && rows_per_table.scalar_type() == at::kLong,
              "bounds_check_indices: rows_per_table must be a 1-D int64 tensor, got ", rows_per_table.scalar_type(),
              " of shape ", rows_per_table.sizes());
  TORCH_CHECK(rows_per_table.is_contiguous(), "bounds_check_indices: rows_per_table must be contiguous");
  TORCH_CHECK(warning.scalar_type() == at::kLong && warning.numel() >= 1 && warning.is_contiguous(),
              "bounds_check_indices: warning must be a contiguous int64 tensor with at least one element, got ",
              warning.scalar_type(), " of shape ", warning.sizes());
  check_same_device(rows_per_table, "rows_per_table", indices);
  check_same_device(offsets, "offsets", indices);
  check_same_device(warning, "warning", indices);
  if (weights.has_value()) {
    check_same_device(*weights, "weights", indices);
    TORCH_CHECK(weights->numel() == indices.numel(), "bounds_check_indices: weights must have one entry per index (",
                indices.numel(), "), got ", weights->numel());
  }

  Layout layout;
  layout.num_tables = rows_per_table.numel();
  layout.total_bags = offsets.numel() - 1;
  const std::int64_t T = layout.num_tables;
  if (B_offsets.has_value()) {
    const at::Tensor& bo = *B_offsets;
    check_same_device(bo, "B_offsets", indices);
    TORCH_CHECK(bo.dim() == 1 && bo.scalar_type() == at::kInt, "bounds_check_indices: B_offsets must be a 1-D int32 ",
                "tensor, got ", bo.scalar_type(), " of shape ", bo.sizes());
    TORCH_CHECK(bo.numel() == T + 1, "bounds_check_indices: B_offsets must have num_tables + 1 = ", T + 1,
                " entries, got ", bo.numel());
    const at::Tensor host = bo.to(at::kCPU, at::kLong).contiguous();
    const std::int64_t* b = host.data_ptr<std::int64_t>();
    layout.b_offsets.assign(b, b + T + 1);
    TORCH_CHECK(layout.b_offsets[0] == 0, "bounds_check_indices: B_offsets[0] must be 0, got ", layout.b_offsets[0]);
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t bt = layout.b_offsets[t + 1] - layout.b_offsets[t];
      TORCH_CHECK(bt >= 0, "bounds_check_indices: B_offsets must be non-decreasing, but B_offsets[", t + 1, "] = ",
                  layout.b_offsets[t + 1], " < B_offsets[", t, "] = ", layout.b_offsets[t]);
      TORCH_CHECK(max_B < 0 || bt <= max_B, "bounds_check_indices: table ", t, " has ", bt,
                  " bags in B_offsets, more than max_B = ", max_B);
    }
    TORCH_CHECK(layout.b_offsets[T] == layout.total_bags, "bounds_check_indices: B_offsets[-1] = ",
                layout.b_offsets[T], " must equal the number of bags, offsets.numel() - 1 = ", layout.total_bags);
  } else if (T == 0) {
    TORCH_CHECK(layout.total_bags == 0, "bounds_check_indices: with no tables, offsets must have exactly one entry, got ",
                offsets.numel());
  } else {
    TORCH_CHECK(layout.total_bags % T == 0, "bounds_check_indices: offsets must have num_tables * B + 1 entries ",
                "(num_tables = ", T, "), got ", offsets.numel());
    layout.batch_size = layout.total_bags / T;
  }
  return layout;
}

std::pair<std::int64_t, std::int64_t> locate_bag(const Layout& layout, std::int64_t g) {
  if (layout.b_offsets.empty()) {
    return layout.batch_size > 0 ? std::make_pair(g / layout.batch_size, g % layout.batch_size)
                                 : std::make_pair<std::int64_t, std::int64_t>(0, 0);
  }
  const auto it = std::upper_bound(layout.b_offsets.begin(), layout.b_offsets.end(), g);
  const std::int64_t t = (it - layout.b_offsets.begin()) - 1;
  return {t, g - layout.b_offsets[t]};
}

void act_on_report(const Report& r, Mode mode, const Layout& layout, std::int64_t n) {
  if (mode == kernels::bounds_check::kIgnore) return;
  const bool last_wrong = r.last_offset_value != n;
  std::ostringstream offsets_msg;
  if (r.first_bad_bag >= 0) {
    const auto tb = locate_bag(layout, r.first_bad_bag);
    offsets_msg << "offsets of table " << tb.first << ", bag " << tb.second << " are [" << r.first_bad_bag_start
                << ", " << r.first_bad_bag_end << "), not within 0 <= start <= end <= num_indices = " << n;
  }
  std::ostringstream index_msg;
  if (r.index_violations > 0) {
    index_msg << "index " << r.first_index_value << " at position " << r.first_index_pos << " (table "
              << r.first_index_table << ", bag " << r.first_index_bag << ") is not in [0, " << r.first_index_limit
              << ")";
  }
  if (mode == kernels::bounds_check::kFatal) {
    TORCH_CHECK(!last_wrong, "bounds_check_indices (FATAL): the last offset is ", r.last_offset_value,
                " but indices has ", n, " entries");
    TORCH_CHECK(r.first_bad_bag < 0, "bounds_check_indices (FATAL): ", offsets_msg.str());
    TORCH_CHECK(r.index_violations == 0, "bounds_check_indices (FATAL): ", index_msg.str(), "; ",
                r.index_violations, " of ", n, " indices are out of bounds");
    return;
  }
  if ((r.index_violations == 0 && r.offset_repairs == 0) || quiet()) return;
  std::ostringstream line;
  line << "[hipdlrm] bounds_check_indices (WARNING): " << r.index_violations << " of " << n
       << " indices out of bounds";
  if (r.index_violations > 0) line << ", set to 0 (first: " << index_msg.str() << ")";
  if (r.offset_repairs > 0) {
    line << "; " << r.offset_repairs << " offset problem(s) repaired";
    if (last_wrong) line << " (last offset " << r.last_offset_value << " set to " << n << ")";
    if (r.first_bad_bag >= 0) line << " (first: " << offsets_msg.str() << ")";
  }
  line << "\n";
  std::fputs(line.str().c_str(), stderr);
  std::fflush(stderr);
}

TORCH_LIBRARY_IMPL(hipdlrm, CPU, m) {
  m.impl("bounds_check_indices", &bounds_check_indices_cpu);
  m.impl("_bounds_check_indices_impl", &bounds_check_indices_impl_cpu);
}

}  // namespace bounds_check
}  // namespace ops
}  // namespace hipdlrm
