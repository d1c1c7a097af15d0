/* engine_hooks.hot_path._hotpath's parts (one file each, joined in module.c): what they share.
 *
 *   scan.c          Scanner: one pass over an engine step's outputs (request ids, token counts,
 *                   the rare outputs), on the engine's thread
 *   method_hook.c   MethodHook: the traced method of EngineHooks.raw and .arrival_fields, which
 *                   records its hook event (engine_hooks/hot_path/hook_events.py) with no Python frame
 *   http_timing.c   TimedSend and TimedTransport: the HTTP server span's response times (each
 *                   body chunk's), at ASGI's send or below it, at the transport's write
 *   traceparent.c   take_traceparent, traceparent: the W3C header read and written
 *
 * Times are CLOCK_MONOTONIC ns, as time.monotonic_ns() reads it. */
#ifndef HOTPATH_H
#define HOTPATH_H

#include "../../../otel_llm/csrc/otel_llm_c.h"
#include <time.h>

static inline long long monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Two exact str objects with the same text. */
static inline int same_str(PyObject *a, PyObject *b) {
    Py_ssize_t n = PyUnicode_GET_LENGTH(a);
    int kind = PyUnicode_KIND(a);
    return n == PyUnicode_GET_LENGTH(b) && kind == PyUnicode_KIND(b) &&
           memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), (size_t)n * kind) == 0;
}

/* ``p``'s first ``k`` bytes are ``lower`` (lowercase ASCII) in any ASCII case: HTTP field names. */
static inline int same_in_any_case(const char *p, const char *lower, Py_ssize_t k) {
    for (Py_ssize_t j = 0; j < k; j++) {
        char c = p[j];
        if ((c >= 'A' && c <= 'Z' ? c | 0x20 : c) != lower[j]) return 0;
    }
    return 1;
}

/* Each part readies its types and interns its strings, then adds what it defines to the module:
 * 0, or -1 with an exception set. */
int hotpath_scan_init(PyObject *module);
int hotpath_method_hook_init(PyObject *module);
int hotpath_http_timing_init(PyObject *module);
extern PyMethodDef hotpath_traceparent_methods[];

#endif
