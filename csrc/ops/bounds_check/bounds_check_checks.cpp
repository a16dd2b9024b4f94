// bounds_check_indices: argument checks, and a call's Report turned into the FATAL error or the WARNING
// line. Shared by the CPU reference and the GPU launch, which produce the same Report.
#include "ops/bounds_check/bounds_check.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace hipdlrm {
namespace ops {
namespace bounds_check {
namespace {

bool quiet() {
  const char* q = std::getenv("HIPDLRM_QUIET_WARNINGS");
  return q != nullptr && q[0] != '\0' && q[0] != '0';
}

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& indices) {
  TORCH_CHECK(t.device() == indices.device(), "bounds_check_indices: ", name, " is on ", t.device(),
              " but indices is on ", indices.device(), "; all tensors must be on one device");
}

}  // namespace

Layout check_arguments(const at::Tensor& rows_per_table, const at::Tensor& indices, const at::Tensor& offsets,
                       std::int64_t mode, const at::Tensor& warning, const c10::optional<at::Tensor>& weights,
                       const c10::optional<at::Tensor>& B_offsets, std::int64_t max_B, bool host_values) {
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
    const at::ScalarType wt = weights->scalar_type();
    TORCH_CHECK(wt == at::kFloat || wt == at::kHalf || wt == at::kBFloat16 || wt == at::kDouble,
                "bounds_check_indices: weights (per-sample weights) must be float32, float16, bfloat16 or float64, "
                "got ", wt);
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
    if (host_values) {
      const at::Tensor host = bo.to(at::kCPU, at::kLong).contiguous();
      const std::int64_t* b = host.data_ptr<std::int64_t>();
      layout.b_offsets.assign(b, b + T + 1);
      namespace kbc = kernels::bounds_check;
      const auto& bo_v = layout.b_offsets;
      TORCH_CHECK(bo_v[0] == 0, b_offsets_message(kbc::kFirstNotZero, 0, bo_v[0], 0));
      for (std::int64_t t = 0; t < T; ++t) {
        const std::int64_t bt = bo_v[t + 1] - bo_v[t];
        TORCH_CHECK(bt >= 0, b_offsets_message(kbc::kDecreasing, t + 1, bo_v[t + 1], bo_v[t]));
        TORCH_CHECK(max_B < 0 || bt <= max_B, b_offsets_message(kbc::kAboveMaxB, t, bt, max_B));
      }
      TORCH_CHECK(bo_v[T] == layout.total_bags, b_offsets_message(kbc::kLastNotBags, T, bo_v[T], layout.total_bags));
    }
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

std::string b_offsets_message(int kind, std::int64_t table, std::int64_t value, std::int64_t other) {
  namespace kbc = kernels::bounds_check;
  std::ostringstream m;
  m << "bounds_check_indices: ";
  switch (kind) {
    case kbc::kFirstNotZero: m << "B_offsets[0] must be 0, got " << value; break;
    case kbc::kDecreasing:
      m << "B_offsets must be non-decreasing, but B_offsets[" << table << "] = " << value << " < B_offsets["
        << table - 1 << "] = " << other;
      break;
    case kbc::kAboveMaxB: m << "table " << table << " has " << value << " bags in B_offsets, more than max_B = " << other; break;
    default:
      m << "B_offsets[-1] = " << value << " must equal the number of bags, offsets.numel() - 1 = " << other;
      break;
  }
  return m.str();
}

void check_rows_per_table_values(const at::Tensor& rows_per_table) {
  const std::int64_t* rows = rows_per_table.data_ptr<std::int64_t>();
  for (std::int64_t t = 0; t < rows_per_table.numel(); ++t)
    TORCH_CHECK(rows[t] >= 0, "bounds_check_indices: rows_per_table[", t, "] = ", rows[t],
                "; every table's row count must be >= 0");
}

std::pair<std::int64_t, std::int64_t> locate_bag(const Layout& layout, std::int64_t g) {
  if (layout.b_offsets.empty()) {
    return layout.batch_size > 0 ? std::make_pair(g / layout.batch_size, g % layout.batch_size)
                                 : std::make_pair<std::int64_t, std::int64_t>(-1, 0);
  }
  const auto it = std::upper_bound(layout.b_offsets.begin(), layout.b_offsets.end(), g);
  const std::int64_t t = (it - layout.b_offsets.begin()) - 1;
  return {t, g - layout.b_offsets[t]};
}

std::string report_message(const Report& r, Mode mode, const Layout& layout, std::int64_t n) {
  if (mode == kernels::bounds_check::kIgnore) return "";
  const bool last_wrong = r.last_offset_value != n;
  std::ostringstream offsets_msg;
  if (r.first_bad_bag >= 0) {
    const auto tb = locate_bag(layout, r.first_bad_bag);
    if (tb.first < 0) {
      offsets_msg << "offsets of bag " << r.first_bad_bag << " (table-major, over every table's B_offsets bags)";
    } else {
      offsets_msg << "offsets of table " << tb.first << ", bag " << tb.second;
    }
    offsets_msg << " are [" << r.first_bad_bag_start << ", " << r.first_bad_bag_end
                << "), not within 0 <= start <= end <= num_indices = " << n;
  }
  std::ostringstream index_msg;
  if (r.index_violations > 0) {
    index_msg << "index " << r.first_index_value << " at position " << r.first_index_pos << " (table "
              << r.first_index_table << ", bag " << r.first_index_bag << ") is not in [0, " << r.first_index_limit
              << ")";
  }
  std::ostringstream msg;
  if (mode == kernels::bounds_check::kFatal) {
    if (last_wrong) {
      msg << "bounds_check_indices (FATAL): the last offset is " << r.last_offset_value << " but indices has " << n
          << " entries";
    } else if (r.first_bad_bag >= 0) {
      msg << "bounds_check_indices (FATAL): " << offsets_msg.str();
    } else if (r.index_violations > 0) {
      msg << "bounds_check_indices (FATAL): " << index_msg.str() << "; " << r.index_violations << " of " << n
          << " indices are out of bounds";
    }
    return msg.str();
  }
  if (r.index_violations == 0 && r.offset_repairs == 0) return "";
  msg << "[hipdlrm] bounds_check_indices (WARNING): " << r.index_violations << " of " << n
      << " indices out of bounds";
  if (r.index_violations > 0) msg << ", set to 0 (first: " << index_msg.str() << ")";
  if (r.offset_repairs > 0) {
    msg << "; " << r.offset_repairs << " offset problem(s) repaired";
    if (last_wrong) msg << " (last offset " << r.last_offset_value << " set to " << n << ")";
    if (r.first_bad_bag >= 0) msg << " (first: " << offsets_msg.str() << ")";
  }
  return msg.str();
}

void act_on_report(const Report& r, Mode mode, const Layout& layout, std::int64_t n) {
  const std::string msg = report_message(r, mode, layout, n);
  if (msg.empty()) return;
  TORCH_CHECK(mode != kernels::bounds_check::kFatal, msg);
  if (quiet()) return;
  std::fputs((msg + "\n").c_str(), stderr);
  std::fflush(stderr);
}

}  // namespace bounds_check
}  // namespace ops
}  // namespace hipdlrm
