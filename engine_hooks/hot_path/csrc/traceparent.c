/* The W3C trace context header, read from an ASGI request's headers and written for a new one
 * (engine_hooks/asgi.py's Python twins follow the same rules, tests/unit/test_asgi.py checks both). */
#include "hotpath.h"

/* A lowercase hex digit's value, else -1: W3C trace context writes ids in lowercase only. */
static int lower_hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* ``n`` bytes from ``2n`` lowercase hex digits into ``out``; 0, or -1 where one is not one. */
static int unhex(const char *p, Py_ssize_t n, unsigned char *out) {
    for (Py_ssize_t i = 0; i < n; i++) {
        int hi = lower_hex_value(p[2 * i]), lo = lower_hex_value(p[2 * i + 1]);
        if (hi < 0 || lo < 0) return -1;
        out[i] = (unsigned char)(hi << 4 | lo);
    }
    return 0;
}

/* A W3C traceparent value (engine_hooks.asgi.parse_traceparent's rules, the OpenTelemetry
 * propagator's): optional spaces or tabs around ``vv-<32 hex>-<16 hex>-<2 hex>``, every digit
 * lowercase, the version not ``ff``; version 00 exactly that, a later version may go on after a
 * ``-``; trace and span id not all zero. (trace id, span id, flags), or None where invalid. */
static PyObject *parse_value(PyObject *v) {
    if (!PyBytes_CheckExact(v)) Py_RETURN_NONE;
    const char *p = PyBytes_AS_STRING(v);
    Py_ssize_t n = PyBytes_GET_SIZE(v);
    while (n && (*p == ' ' || *p == '\t')) p++, n--;
    while (n && (p[n - 1] == ' ' || p[n - 1] == '\t')) n--;
    unsigned char ver, tid[16], sid[8], flags;
    if (n < 55 || p[2] != '-' || p[35] != '-' || p[52] != '-' || unhex(p, 1, &ver) < 0 || ver == 0xff ||
        unhex(p + 3, 16, tid) < 0 || unhex(p + 36, 8, sid) < 0 || unhex(p + 53, 1, &flags) < 0 ||
        all_zero(tid, 16) || all_zero(sid, 8) || (n > 55 && (ver == 0 || p[55] != '-')))
        Py_RETURN_NONE;
    return Py_BuildValue("(y#y#i)", (const char *)tid, (Py_ssize_t)16, (const char *)sid, (Py_ssize_t)8, (int)flags);
}

/* take_traceparent(headers) -> (trace id, span id, flags) | None: the caller's W3C trace context
 * taken out of an ASGI request's header list, in place, as engine_hooks.asgi.take_traceparent
 * does in Python. The first header named ``traceparent`` (any ASCII case) is the parent where
 * valid; every header of that name is removed (a second one must not reach the app), and where
 * no valid parent was found every ``tracestate`` header too (a new trace starts: the state of
 * another belongs to none of it). TypeError, the list untouched, where ``headers`` is not a list
 * of (bytes, value) tuples: the caller does it in Python. */
static PyObject *take_traceparent(PyObject *self, PyObject *headers) {
    if (!PyList_CheckExact(headers)) {
        PyErr_SetString(PyExc_TypeError, "headers: a list of (name, value) tuples");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(headers), parents = 0, states = 0;
    PyObject *parent = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyList_GET_ITEM(headers, i);
        if (!PyTuple_CheckExact(h) || PyTuple_GET_SIZE(h) != 2 || !PyBytes_CheckExact(PyTuple_GET_ITEM(h, 0))) {
            Py_XDECREF(parent);
            PyErr_SetString(PyExc_TypeError, "headers: a list of (name, value) tuples");
            return NULL;
        }
        PyObject *k = PyTuple_GET_ITEM(h, 0);
        Py_ssize_t kn = PyBytes_GET_SIZE(k);
        if (kn == 11 && same_in_any_case(PyBytes_AS_STRING(k), "traceparent", 11)) {
            if (parents++ == 0) {
                parent = parse_value(PyTuple_GET_ITEM(h, 1));
                if (parent == NULL) return NULL;
            }
        } else if (kn == 10 && same_in_any_case(PyBytes_AS_STRING(k), "tracestate", 10))
            states++;
    }
    if (parent == NULL) { /* no traceparent header at all */
        parent = Py_None;
        Py_INCREF(parent);
    }
    int drop_state = parent == Py_None && states;
    if (parents || drop_state) { /* the headers kept, put in place at once (a dropped one's value may
                                  * run Python code as it goes: never while this walks the list) */
        PyObject *kept = PyList_New(0);
        int ok = kept != NULL;
        for (Py_ssize_t i = 0; ok && i < n; i++) {
            PyObject *h = PyList_GET_ITEM(headers, i);
            PyObject *k = PyTuple_GET_ITEM(h, 0);
            Py_ssize_t kn = PyBytes_GET_SIZE(k);
            const char *kp = PyBytes_AS_STRING(k);
            int drop = (kn == 11 && same_in_any_case(kp, "traceparent", 11)) ||
                       (drop_state && kn == 10 && same_in_any_case(kp, "tracestate", 10));
            if (!drop) ok = PyList_Append(kept, h) == 0;
        }
        ok = ok && PyList_SetSlice(headers, 0, n, kept) == 0;
        Py_XDECREF(kept);
        if (!ok) {
            Py_DECREF(parent);
            return NULL;
        }
    }
    return parent;
}

/* traceparent(trace_id, span_id, flags) -> bytes: the W3C header value, version 00, lowercase */
static PyObject *traceparent(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_CheckExact(args[0]) || PyBytes_GET_SIZE(args[0]) != 16 ||
        !PyBytes_CheckExact(args[1]) || PyBytes_GET_SIZE(args[1]) != 8 || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "traceparent(trace_id: 16 bytes, span_id: 8 bytes, flags: int)");
        return NULL;
    }
    long flags = PyLong_AsLong(args[2]);
    if (flags == -1 && PyErr_Occurred()) return NULL;
    if (flags < 0 || flags > 255) {
        PyErr_SetString(PyExc_ValueError, "flags: 0-255");
        return NULL;
    }
    static const char digits[] = "0123456789abcdef";
    char out[55];
    const unsigned char *t = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    const unsigned char *s = (const unsigned char *)PyBytes_AS_STRING(args[1]);
    memcpy(out, "00-", 3);
    for (int i = 0; i < 16; i++) out[3 + 2 * i] = digits[t[i] >> 4], out[4 + 2 * i] = digits[t[i] & 15];
    out[35] = '-';
    for (int i = 0; i < 8; i++) out[36 + 2 * i] = digits[s[i] >> 4], out[37 + 2 * i] = digits[s[i] & 15];
    out[52] = '-';
    out[53] = digits[flags >> 4];
    out[54] = digits[flags & 15];
    return PyBytes_FromStringAndSize(out, 55);
}

PyMethodDef hotpath_traceparent_methods[] = {
    {"take_traceparent", take_traceparent, METH_O,
     "take_traceparent(headers) -> None | (trace id, span id, flags): the caller's traceparent, taken out (see the source)"},
    {"traceparent", (PyCFunction)(void (*)(void))traceparent, METH_FASTCALL,
     "traceparent(trace_id, span_id, flags) -> bytes: a W3C traceparent value"},
    {NULL, NULL, 0, NULL},
};
