// Argument checks shared by the attention ops (HSTU and GDPA): supported dtypes and head dims, devices,
// index tensors, and the values of a jagged offsets tensor once it is on the host.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <cstdint>
#include <limits>
#include <mutex>

namespace hipdlrm {
namespace ops {
namespace attention {

// Lengths, heads and the batch size reach the kernels as int.
constexpr std::int64_t kIntMax = std::numeric_limits<std::int32_t>::max();

inline bool supported_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

inline bool supported_head_dim(std::int64_t d) { return d == 32 || d == 64 || d == 128 || d == 256; }

// The composite implementations compute in fp32, or in fp64 for fp64 inputs.
inline at::ScalarType compute_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// `t` (called `name`) must be on the device of `ref` (called `ref_name`).
inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                              const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device(), "; every tensor must be on one device");
}

// A 1-D int32/int64 tensor of the given shape description, on ref's device.
inline void check_index_tensor(const char* op, const char* name, const char* shape, const at::Tensor& t,
                               const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK(t.dim() == 1, op, ": ", name, " must be 1-D ", shape, ", got shape ", t.sizes());
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", name,
              " must be int32 or int64, got ", t.scalar_type());
  check_same_device(op, name, t, ref_name, ref);
}

// Host values off[0 .. batch] of the offsets tensor `name`: first 0, non-decreasing, last equal to `rows`
// (described by rows_desc, e.g. "L = q.size(0)"), and no sequence longer than max_len (called max_name).
inline void check_offsets(const char* op, const char* name, const std::int64_t* off, std::int64_t batch,
                          std::int64_t rows, const char* rows_desc, std::int64_t max_len, const char* max_name) {
  TORCH_CHECK(off[0] == 0, op, ": ", name, "[0] must be 0, got ", off[0]);
  for (std::int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(off[b + 1] >= off[b], op, ": ", name, " must be non-decreasing, but ", name, "[", b + 1, "] = ",
                off[b + 1], " < ", name, "[", b, "] = ", off[b]);
  }
  TORCH_CHECK(off[batch] == rows, op, ": ", name, "[B] = ", name, "[", batch, "] = ", off[batch], " must equal ",
              rows_desc, " = ", rows);
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t n = off[b + 1] - off[b];
    TORCH_CHECK(n <= max_len, op, ": sequence ", b, " has length ", n, " (", name, "[", b + 1, "] - ", name, "[", b,
                "]) but ", max_name, " is ", max_len, "; ", max_name, " must be at least the longest sequence");
  }
}

// Device-resident offsets tensors whose values passed the host checks, remembered by identity, so that a later
// call with the same unchanged tensors and the same sizes (a backward after its forward, or one training step's
// repeated calls) skips the device-to-host copy of the values -- a stream synchronisation that leaves the GPU
// idle while the host prepares the launch. A tensor matches only while it is alive (a weak reference to its
// TensorImpl: a new tensor in freed memory never matches), unchanged (its version counter, which every in-place
// op and view write bumps), with the same data pointer and length; `context` holds the other numbers the checks
// depended on (row counts, max lengths, batch). CPU tensors and inference tensors (no version counter) are never
// remembered. Callers that need the values on the host (the composite paths) do not use it.
class CheckedOffsets {
 public:
  static constexpr int kTensors = 2;  // e.g. seq_offsets and num_targets, or query_offset and key_offset
  static constexpr int kContext = 5;
  using Tensors = std::array<const at::Tensor*, kTensors>;  // null: no tensor in that slot
  using Context = std::array<std::int64_t, kContext>;

  static CheckedOffsets& instance() {
    // Never destroyed: its weak references must not be released during static destruction at exit, when the
    // tensors they point to may already be gone with the interpreter.
    static CheckedOffsets* const memo = new CheckedOffsets();
    return *memo;
  }
  bool contains(const Tensors& ts, const Context& context) {
    if (!rememberable(ts)) return false;
    const std::lock_guard<std::mutex> lock(mutex_);
    for (const Entry& e : entries_) {
      if (e.matches(ts, context)) return true;
    }
    return false;
  }
  void remember(const Tensors& ts, const Context& context) {
    if (!rememberable(ts)) return;
    const std::lock_guard<std::mutex> lock(mutex_);
    Entry& e = entries_[next_];
    next_ = (next_ + 1) % kEntries;
    e.context = context;
    for (int i = 0; i < kTensors; ++i) e.refs[i] = Ref::of(ts[i]);
  }

 private:
  static constexpr int kEntries = 16;
  using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct Ref {
    bool used = false;
    WeakImpl impl{c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>()};
    std::int64_t version = 0;
    const void* data = nullptr;
    std::int64_t numel = 0;
    at::ScalarType dtype = at::kLong;

    static Ref of(const at::Tensor* t) {
      Ref r;
      if (t == nullptr) return r;
      r.used = true;
      r.impl = WeakImpl(t->getIntrusivePtr());
      r.version = t->_version();
      r.data = t->data_ptr();
      r.numel = t->numel();
      r.dtype = t->scalar_type();
      return r;
    }
    bool matches(const at::Tensor* t) const {
      if (t == nullptr || !used) return t == nullptr && !used;
      const auto alive = impl.lock();  // null once the tensor is gone
      return alive.get() == t->unsafeGetTensorImpl() && version == t->_version() && data == t->data_ptr() &&
             numel == t->numel() && dtype == t->scalar_type();
    }
  };
  struct Entry {
    std::array<Ref, kTensors> refs;
    Context context{};
    bool matches(const Tensors& ts, const Context& c) const {
      if (context != c) return false;
      for (int i = 0; i < kTensors; ++i) {
        if (!refs[i].matches(ts[i])) return false;
      }
      return true;
    }
  };
  static bool rememberable(const Tensors& ts) {
    for (const at::Tensor* t : ts) {
      if (t != nullptr && (!t->defined() || t->is_cpu() || t->is_inference())) return false;
    }
    return ts[0] != nullptr;
  }

  std::mutex mutex_;
  std::array<Entry, kEntries> entries_;
  int next_ = 0;
};

}  // namespace attention
}  // namespace ops
}  // namespace hipdlrm
