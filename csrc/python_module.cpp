// An empty Python module `flash_attention_sm75._C`: importing it loads this shared library, whose
// static initializers register the ops (torch_bindings.cpp). No pybind11, so the ops are plain
// torch.ops and torch.compile traces them without graph breaks. Built with the limited API.
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", "flash-attention-sm75 op library (ops under torch.ops.flash_attention_sm75)",
      -1, nullptr};
  return PyModule_Create(&module_def);
}
}
