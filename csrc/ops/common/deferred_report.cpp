#include "ops/common/deferred_report.h"

#include "ops/common/block_check.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

namespace hipdlrm {
namespace ops {
namespace common {
namespace {

struct Registry {
  std::mutex mu;
  std::vector<std::function<void()>> flushes;
  std::vector<std::function<void()>> synchronizers;
};

// Never destroyed, so that a flush at process exit finds it whatever the order of static destruction.
Registry& registry() {
  static auto* r = new Registry();
  return *r;
}

std::atomic<bool>& strict_flag() {
  static std::atomic<bool> flag([] {
    const char* v = std::getenv("HIPDLRM_STRICT_CHECKS");
    return v != nullptr && *v != '\0' && std::strcmp(v, "0") != 0;
  }());
  return flag;
}

std::vector<std::function<void()>> copy_of(std::vector<std::function<void()>> Registry::*list) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.*list;
}

}  // namespace

void register_flush(std::function<void()> flush) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.flushes.push_back(std::move(flush));
}

void flush_deferred_reports() {
  for (const auto& f : copy_of(&Registry::flushes)) f();
}

void register_synchronize(std::function<void()> synchronize) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.synchronizers.push_back(std::move(synchronize));
}

bool strict_checks() { return strict_flag().load(std::memory_order_relaxed); }

void define(torch::Library& m) {
  // Waits for every device hipdlrm has run on, prints pending WARNING lines and raises the first pending
  // device error.
  m.def("_synchronize() -> ()", [] {
    flush_deferred_reports();
    for (const auto& f : copy_of(&Registry::synchronizers)) f();
  });
  m.def("_set_strict_checks(bool enabled) -> ()",
        [](bool enabled) { strict_flag().store(enabled, std::memory_order_relaxed); });
  m.def("_strict_checks() -> bool", [] { return strict_checks(); });
  define_block_check(m);
}

}  // namespace common
}  // namespace ops
}  // namespace hipdlrm
