/* otel_llm.otlp._int_text: an int64 array as the text of OTLP/JSON AnyValue elements.
 *
 * values_json(buffer) -> str: for a contiguous buffer of int64 (array('q'), a numpy int64 array),
 * the elements as json.dumps writes the protobuf JSON mapping of AnyValue(int_value=v), joined by
 * commas: {"intValue":"12"},{"intValue":"-3"} (int64 is a string in proto3 JSON). The OTLP/JSON
 * writer (otel_llm.otlp.otlp_encode) puts it inside {"arrayValue":{"values":[...]}}. In Python,
 * each element costs a str object and a join; here about ten instructions a digit. Optional: the
 * writer does the same in Python without it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const char HEAD[] = "{\"intValue\":\"";
#define HEAD_LEN (sizeof(HEAD) - 1)

static PyObject *values_json(PyObject *self, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    const char *fmt = view.format ? view.format : "B";
    if (fmt[0] == '@' || fmt[0] == '=' || fmt[0] == '<') fmt++;
    if (view.itemsize != 8 || (strcmp(fmt, "q") != 0 && strcmp(fmt, "l") != 0)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "values_json takes a contiguous buffer of int64");
        return NULL;
    }
    Py_ssize_t n = view.len / 8;
    /* each element at most: head, a sign and 19 digits, "}, and a comma */
    size_t cap = (size_t)n * (HEAD_LEN + 20 + 3) + 1;
    char *buf = PyMem_Malloc(cap);
    if (buf == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    const int64_t *v = (const int64_t *)view.buf;
    char *p = buf;
    char digits[24];
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i) *p++ = ',';
        memcpy(p, HEAD, HEAD_LEN);
        p += HEAD_LEN;
        int64_t x = v[i];
        uint64_t u = x < 0 ? (uint64_t)0 - (uint64_t)x : (uint64_t)x;
        if (x < 0) *p++ = '-';
        int k = 0;
        do {
            digits[k++] = (char)('0' + u % 10);
            u /= 10;
        } while (u);
        while (k) *p++ = digits[--k];
        *p++ = '"';
        *p++ = '}';
    }
    PyBuffer_Release(&view);
    PyObject *out = PyUnicode_New(p - buf, 127);
    if (out != NULL) memcpy(PyUnicode_DATA(out), buf, (size_t)(p - buf));
    PyMem_Free(buf);
    return out;
}

static PyMethodDef methods[] = {
    {"values_json", values_json, METH_O,
     "values_json(int64 buffer) -> str: {\"intValue\":\"v\"},... for each element (see the source)"},
    {NULL, NULL, 0, NULL},
};

/* Multi-phase initialisation (PEP 489); no state of its own, so any interpreter may import it. */
static PyModuleDef_Slot slots[] = {
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_int_text",
    .m_doc = "Integer arrays as OTLP/JSON text, in C (see the source).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC PyInit__int_text(void) { return PyModuleDef_Init(&module); }
