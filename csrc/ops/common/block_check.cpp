#include "ops/common/block_check.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <sstream>
#include <utility>
#include <vector>

namespace hipdlrm {
namespace ops {
namespace common {
namespace {

struct Labels {
  std::mutex mu;
  std::vector<std::pair<std::string, std::string>> names;
};

Labels& labels() {
  static auto* l = new Labels();
  return *l;
}

void check_arguments(const at::Tensor& starts, const at::Tensor& sizes, std::int64_t limit) {
  TORCH_CHECK(starts.dim() == 1 && starts.scalar_type() == at::kLong && starts.is_contiguous(),
              "_check_blocks: starts must be a contiguous 1-D int64 tensor, got ", starts.scalar_type(), " of shape ",
              starts.sizes());
  TORCH_CHECK(sizes.dim() == 1 && sizes.scalar_type() == at::kLong && sizes.is_contiguous() &&
                  sizes.numel() == starts.numel(),
              "_check_blocks: sizes must be a contiguous 1-D int64 tensor of starts' length ", starts.numel(),
              ", got ", sizes.scalar_type(), " of shape ", sizes.sizes());
  TORCH_CHECK(sizes.device() == starts.device(), "_check_blocks: sizes is on ", sizes.device(), " but starts is on ",
              starts.device());
  TORCH_CHECK(limit >= 0, "_check_blocks: limit must be >= 0, got ", limit);
}

void check_blocks_cpu(const at::Tensor& starts, const at::Tensor& sizes, std::int64_t limit, c10::string_view op,
                      c10::string_view argument) {
  check_arguments(starts, sizes, limit);
  const std::int64_t* s = starts.data_ptr<std::int64_t>();
  const std::int64_t* n = sizes.data_ptr<std::int64_t>();
  for (std::int64_t i = 0; i < starts.numel(); ++i)
    TORCH_CHECK(n[i] <= 0 || (s[i] >= 0 && s[i] <= limit - n[i]),  // an empty block may be anywhere
                block_message(std::string(op), std::string(argument), i, s[i], n[i], limit));
}

}  // namespace

std::string block_message(const std::string& op, const std::string& argument, std::int64_t i, std::int64_t start,
                          std::int64_t size, std::int64_t limit) {
  std::ostringstream m;
  m << op << ": " << argument << "[" << i << "] = " << start << " places a block of " << size
    << " elements outside the " << limit << " elements of its buffer";
  return m.str();
}

std::int64_t block_label(const std::string& op, const std::string& argument) {
  Labels& l = labels();
  std::lock_guard<std::mutex> lock(l.mu);
  const auto key = std::make_pair(op, argument);
  for (std::size_t i = 0; i < l.names.size(); ++i)
    if (l.names[i] == key) return static_cast<std::int64_t>(i);
  l.names.push_back(key);
  return static_cast<std::int64_t>(l.names.size() - 1);
}

std::pair<std::string, std::string> block_label_names(std::int64_t label) {
  Labels& l = labels();
  std::lock_guard<std::mutex> lock(l.mu);
  if (label < 0 || label >= static_cast<std::int64_t>(l.names.size())) return {"hipdlrm", "a block offset"};
  return l.names[static_cast<std::size_t>(label)];
}

void define_block_check(torch::Library& m) {
  m.def("_check_blocks(Tensor starts, Tensor sizes, int limit, str op, str argument) -> ()");
}

TORCH_LIBRARY_IMPL(hipdlrm, CPU, m) { m.impl("_check_blocks", &check_blocks_cpu); }

}  // namespace common
}  // namespace ops
}  // namespace hipdlrm
