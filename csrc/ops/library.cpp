// The hipdlrm operator library: every schema is defined here, once, by its family's define function.
// Kernels for each dispatch key are registered in the family's folder (TORCH_LIBRARY_IMPL per key).
#include <torch/library.h>

#include "attention/attention.h"
#include "bounds_check/bounds_check.h"
#include "group_index_select/group_index_select.h"
#include "tbe/tbe.h"

TORCH_LIBRARY(hipdlrm, m) {
  hipdlrm::ops::attention::define(m);
  hipdlrm::ops::bounds_check::define(m);
  hipdlrm::ops::group_index_select::define(m);
  hipdlrm::ops::tbe::define(m);
  hipdlrm::ops::tbe::define_backward(m);
}

#if defined(HIPDLRM_PYTHON_MODULE)
#include <Python.h>
// `import hipdlrm._C` loads this library (and so runs the registrations above); the module itself is
// empty: everything is reached through torch.ops.hipdlrm.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
#endif
