// The hipdlrm operator library: every schema is defined here, once, by its family's define function.
// Kernels for each dispatch key are registered in the family's folder (TORCH_LIBRARY_IMPL per key).
#include <torch/library.h>

#include "ops/attention/attention.h"
#include "ops/bounds_check/bounds_check.h"
#include "ops/common/deferred_report.h"
#include "ops/group_index_select/group_index_select.h"
#include "ops/tbe/tbe.h"

TORCH_LIBRARY(hipdlrm, m) {
  hipdlrm::ops::attention::define(m);
  hipdlrm::ops::bounds_check::define(m);
  hipdlrm::ops::common::define(m);
  hipdlrm::ops::group_index_select::define(m);
  hipdlrm::ops::tbe::define(m);
  hipdlrm::ops::tbe::define_backward(m);
}

#if defined(HIPDLRM_PYTHON_MODULE)
#include <Python.h>
// `import hipdlrm._C` loads this library (and so runs the registrations above). Everything is reached
// through torch.ops.hipdlrm; the module holds only what the build was (hipdlrm.build_info() reads it):
// gpu_backend ("cpu", "cuda" or "rocm") and sm90a_kernels (1 when the Hopper wgmma kernels were built).
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
#if !defined(HIPDLRM_WITH_GPU)
  const char* backend = "cpu";
#elif defined(USE_ROCM)
  const char* backend = "rocm";
#else
  const char* backend = "cuda";
#endif
#if defined(HIPDLRM_SM90A_KERNELS)
  const long sm90a = 1;
#else
  const long sm90a = 0;
#endif
  if (PyModule_AddStringConstant(m, "gpu_backend", backend) != 0 ||
      PyModule_AddIntConstant(m, "sm90a_kernels", sm90a) != 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
#endif
