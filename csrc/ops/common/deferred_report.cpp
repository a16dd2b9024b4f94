#include "ops/common/deferred_report.h"

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
};

// Never destroyed, so that a flush at process exit finds it whatever the order of static destruction.
Registry& registry() {
  static auto* r = new Registry();
  return *r;
}

}  // namespace

void register_flush(std::function<void()> flush) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.flushes.push_back(std::move(flush));
}

void flush_deferred_reports() {
  Registry& r = registry();
  std::vector<std::function<void()>> flushes;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    flushes = r.flushes;
  }
  for (const auto& f : flushes) f();
}

}  // namespace common
}  // namespace ops
}  // namespace hipdlrm
