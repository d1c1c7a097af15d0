/* What otel-llm's C accelerators share (engine_hooks/hot_path/csrc, collector/receivers/_otlp_walk.c):
 * small helpers, and the CPython API differences between the versions the package supports
 * (3.10 on), so that no file uses an API deprecated in a later one. Header-only: each extension
 * module gets its own copy of these static inline functions. */
#ifndef OTEL_LLM_C_H
#define OTEL_LLM_C_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* Whether the ``n`` bytes at ``p`` are all zero (an invalid W3C / OTLP trace or span id). */
static inline int all_zero(const unsigned char *p, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

/* Member types of a member descriptor's slot that hold an object (structmember.h's names are
 * deprecated from 3.12; the values are the same in every version). */
#if PY_VERSION_HEX >= 0x030C0000
#define OTEL_LLM_T_OBJECT _Py_T_OBJECT
#define OTEL_LLM_T_OBJECT_EX Py_T_OBJECT_EX
#else
#include <structmember.h>
#define OTEL_LLM_T_OBJECT T_OBJECT
#define OTEL_LLM_T_OBJECT_EX T_OBJECT_EX
#endif

/* The exception being raised, taken off the thread (owned by the caller; NULL where none),
 * normalised, its traceback set on it: PyErr_GetRaisedException from 3.12, PyErr_Fetch before. */
static inline PyObject *take_exception(void) {
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

/* Raise ``exc`` again (taking the caller's reference), as take_exception gave it. */
static inline void raise_again(PyObject *exc) {
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(exc);
#else
    if (exc == NULL) return;
    PyObject *tb = PyException_GetTraceback(exc); /* a new reference, or NULL */
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, tb);
#endif
}

#endif
