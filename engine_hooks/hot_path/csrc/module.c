/* engine_hooks.hot_path._hotpath: the hooks' work that runs for every engine step and every streamed chunk,
 * in C (hotpath.h lists the parts; each file says what it does). Optional: without it the hooks
 * run their Python twins (otel_llm/accelerator.py decides, OTEL_LLM_PURE_PYTHON=1 turns it off).
 *
 * Multi-phase initialisation (PEP 489). The types are static, and each part keeps a few interned
 * strings in static variables, made once: the module is for the main interpreter only (from 3.12
 * it says so, and a subinterpreter that imports it gets an ImportError). */
#include "hotpath.h"

static int exec_module(PyObject *module) {
    if (hotpath_scan_init(module) < 0 || hotpath_method_hook_init(module) < 0 || hotpath_http_timing_init(module) < 0)
        return -1;
    return PyModule_AddFunctions(module, hotpath_traceparent_methods);
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "engine_hooks.hot_path._hotpath",
    .m_doc = "The hooks' per-step and per-chunk work in C (see engine_hooks/hot_path/csrc).",
    .m_size = 0,
    .m_slots = slots,
};

PyMODINIT_FUNC PyInit__hotpath(void) { return PyModuleDef_Init(&module_def); }
