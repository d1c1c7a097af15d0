/* MethodHook(fn, extract, expander, owner, hook_failed, method_failed, kind, arrival): a traced
 * method, as engine_hooks.api's Python wrappers for EngineHooks.raw and EngineHooks.arrival_fields
 * are, in C: ``fn(*args, **kwargs)`` called with the caller's own arguments (vectorcall: no tuple or
 * dict built), then ``extract(result, *args, **kwargs)`` likewise, and one hook event recorded by
 * ``owner._rec(event)`` (looked up at each call: the owner's pipeline is made on first use, and may
 * be changed). The events are engine_hooks/hot_path/hook_events.py's (tests/unit/test_hook_events.py checks
 * these tuples against that declaration):
 *   raw (arrival false): ``(kind, mono, expander, payload)``, the payload extract's;
 *   arrival: extract gives the arrival's fields after ``mono``, the start as wall ns or None
 *     (``(request id, start, input tokens, trace headers, attributes)``); nothing when the id is
 *     None, else ``(kind, mono, request_id, start_mono, ...)``, the start placed on the monotonic
 *     clock as an age (``now - max(0, wall now - start)``), the other fields as they are.
 * An exception (an Exception) of extract or record goes to ``hook_failed(exc)`` and the caller
 * gets its result all the same (unless hook_failed raises: strict mode). One of fn's own goes to
 * ``method_failed(exc, args, kwargs)`` where that is not None, then on to the caller as it was.
 * A descriptor like a function (bound to the instance it is read from) with a __dict__ (what
 * functools.wraps and mark_hooked set). */
#include "hotpath.h"

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *fn, *extract, *expander, *owner, *hook_failed, *method_failed, *kind, *dict;
    int arrival;
} MethodHook;

static PyObject *s_rec;

#define HOOK_STACK_ARGS 16

/* extract(result, *args, **kwargs) for the caller's vectorcall arguments. */
static PyObject *call_extract(PyObject *extract, PyObject *res, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs + nkw + 1 <= HOOK_STACK_ARGS) {
        PyObject *stack[HOOK_STACK_ARGS];
        stack[0] = res;
        memcpy(stack + 1, args, (size_t)(nargs + nkw) * sizeof(PyObject *));
        return PyObject_Vectorcall(extract, stack, (size_t)nargs + 1, kwnames);
    }
    PyObject **stack = PyMem_Malloc((size_t)(nargs + nkw + 1) * sizeof(PyObject *)); /* many arguments */
    if (stack == NULL) return PyErr_NoMemory();
    stack[0] = res;
    memcpy(stack + 1, args, (size_t)(nargs + nkw) * sizeof(PyObject *));
    PyObject *out = PyObject_Vectorcall(extract, stack, (size_t)nargs + 1, kwnames);
    PyMem_Free(stack);
    return out;
}

/* fn raised: ``method_failed(exc, args, kwargs)``, then fn's exception raised again as it was
 * (or, where method_failed raises: strict mode, that one). Always NULL. */
static PyObject *method_raised(MethodHook *h, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *exc = take_exception();
    PyObject *a = PyTuple_New(nargs), *k = PyDict_New(), *r = NULL;
    if (a != NULL && k != NULL) {
        for (Py_ssize_t i = 0; i < nargs; i++) PyTuple_SET_ITEM(a, i, Py_NewRef(args[i]));
        int ok = 1;
        for (Py_ssize_t i = 0; ok && kwnames != NULL && i < PyTuple_GET_SIZE(kwnames); i++)
            ok = PyDict_SetItem(k, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) == 0;
        if (ok) r = PyObject_CallFunctionObjArgs(h->method_failed, exc ? exc : Py_None, a, k, NULL);
    }
    Py_XDECREF(a);
    Py_XDECREF(k);
    if (r == NULL) { /* strict: the hook's failure goes on instead */
        Py_XDECREF(exc);
        return NULL;
    }
    Py_DECREF(r);
    raise_again(exc); /* the method's own exception, as it was */
    return NULL;
}

/* The arrival event of extract's fields ``x`` at ``now``: ``(kind, mono, request_id, start_mono,
 * *the rest of x)``, x's start (wall ns) placed on the monotonic clock. A new tuple, Py_None (a new
 * reference) where the id is None, or NULL with an exception set. Every field after the start is
 * passed on as it is: a field added to the arrival (hook_events.py) needs no change here. */
static PyObject *arrival_event(MethodHook *h, PyObject *x, PyObject *t, long long now) {
    if (!PyTuple_Check(x) || PyTuple_GET_SIZE(x) < 2) {
        PyErr_SetString(PyExc_TypeError, "an arrival's fields: a tuple (request id, start, ...)");
        return NULL;
    }
    if (PyTuple_GET_ITEM(x, 0) == Py_None) return Py_NewRef(Py_None); /* refused without an id */
    PyObject *start = PyTuple_GET_ITEM(x, 1), *placed;
    if (start == Py_None) {
        placed = Py_NewRef(Py_None);
    } else {
        PyObject *as_int = PyNumber_Long(start); /* an int, a float, a numpy integer */
        long long s0 = as_int != NULL ? PyLong_AsLongLong(as_int) : -1;
        Py_XDECREF(as_int);
        if (s0 == -1 && PyErr_Occurred()) return NULL;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        long long age = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec - s0;
        placed = PyLong_FromLongLong(now - (age > 0 ? age : 0));
        if (placed == NULL) return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(x);
    PyObject *ev = PyTuple_New(n + 2);
    if (ev == NULL) {
        Py_DECREF(placed);
        return NULL;
    }
    PyTuple_SET_ITEM(ev, 0, Py_NewRef(h->kind));
    PyTuple_SET_ITEM(ev, 1, Py_NewRef(t));
    PyTuple_SET_ITEM(ev, 2, Py_NewRef(PyTuple_GET_ITEM(x, 0)));
    PyTuple_SET_ITEM(ev, 3, placed);
    for (Py_ssize_t i = 2; i < n; i++) PyTuple_SET_ITEM(ev, i + 2, Py_NewRef(PyTuple_GET_ITEM(x, i)));
    return ev;
}

/* The event of this call (extract's result ``x``): a new reference, Py_None for none, or NULL
 * with an exception set. */
static PyObject *make_event(MethodHook *h, PyObject *x) {
    long long now = monotonic();
    PyObject *t = PyLong_FromLongLong(now);
    if (t == NULL) return NULL;
    PyObject *ev = h->arrival ? arrival_event(h, x, t, now) : PyTuple_Pack(4, h->kind, t, h->expander, x);
    Py_DECREF(t);
    return ev;
}

/* ``owner._rec(event)``: 0, or -1 with an exception set. */
static int record(MethodHook *h, PyObject *ev) {
    PyObject *rec = PyObject_GetAttr(h->owner, s_rec);
    if (rec == NULL) return -1;
    PyObject *ok = PyObject_CallOneArg(rec, ev);
    Py_DECREF(rec);
    if (ok == NULL) return -1;
    Py_DECREF(ok);
    return 0;
}

static PyObject *mh_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    MethodHook *h = (MethodHook *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *res = PyObject_Vectorcall(h->fn, args, nargsf, kwnames);
    if (res == NULL) return h->method_failed == Py_None ? NULL : method_raised(h, args, nargs, kwnames);
    int rc = -1;
    PyObject *x = call_extract(h->extract, res, args, nargs, kwnames);
    if (x != NULL) {
        PyObject *ev = make_event(h, x);
        Py_DECREF(x);
        if (ev != NULL) {
            rc = ev == Py_None ? 0 : record(h, ev);
            Py_DECREF(ev);
        }
    }
    if (rc == 0) return res;
    if (!PyErr_ExceptionMatches(PyExc_Exception)) { /* KeyboardInterrupt, SystemExit: not ours to keep */
        Py_DECREF(res);
        return NULL;
    }
    PyObject *exc = take_exception();
    PyObject *r = exc != NULL ? PyObject_CallOneArg(h->hook_failed, exc) : NULL;
    Py_XDECREF(exc);
    if (r == NULL) { /* strict: the hook's failure is raised */
        Py_DECREF(res);
        return NULL;
    }
    Py_DECREF(r);
    return res;
}

static PyObject *mh_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *v[7];
    int arrival;
    if (!PyArg_ParseTuple(args, "OOOOOOOp:MethodHook", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &arrival))
        return NULL;
    MethodHook *h = (MethodHook *)type->tp_alloc(type, 0);
    if (h == NULL) return NULL;
    h->vectorcall = mh_call;
    h->arrival = arrival;
    PyObject **slots[] = {&h->fn, &h->extract, &h->expander, &h->owner, &h->hook_failed, &h->method_failed, &h->kind};
    for (int i = 0; i < 7; i++) *slots[i] = Py_NewRef(v[i]);
    return (PyObject *)h;
}

static PyObject *mh_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static int mh_traverse(MethodHook *h, visitproc visit, void *arg) {
    Py_VISIT(h->fn);
    Py_VISIT(h->extract);
    Py_VISIT(h->expander);
    Py_VISIT(h->owner);
    Py_VISIT(h->hook_failed);
    Py_VISIT(h->method_failed);
    Py_VISIT(h->kind);
    Py_VISIT(h->dict);
    return 0;
}

static int mh_clear(MethodHook *h) {
    Py_CLEAR(h->fn);
    Py_CLEAR(h->extract);
    Py_CLEAR(h->expander);
    Py_CLEAR(h->owner);
    Py_CLEAR(h->hook_failed);
    Py_CLEAR(h->method_failed);
    Py_CLEAR(h->kind);
    Py_CLEAR(h->dict);
    return 0;
}

static void mh_dealloc(MethodHook *h) {
    PyObject_GC_UnTrack(h);
    mh_clear(h);
    Py_TYPE(h)->tp_free((PyObject *)h);
}

static PyGetSetDef mh_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject MethodHookType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engine_hooks.hot_path._hotpath.MethodHook",
    .tp_basicsize = sizeof(MethodHook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "MethodHook(fn, extract, expander, owner, hook_failed, method_failed, kind, arrival): a traced "
              "method (see the source)",
    .tp_new = mh_new,
    .tp_dealloc = (destructor)mh_dealloc,
    .tp_traverse = (traverseproc)mh_traverse,
    .tp_clear = (inquiry)mh_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(MethodHook, vectorcall),
    .tp_descr_get = mh_get,
    .tp_dictoffset = offsetof(MethodHook, dict),
    .tp_getset = mh_getset,
};

int hotpath_method_hook_init(PyObject *module) {
    if (s_rec == NULL && (s_rec = PyUnicode_InternFromString("_rec")) == NULL) return -1;
    if (PyType_Ready(&MethodHookType) < 0) return -1;
    return PyModule_AddObjectRef(module, "MethodHook", (PyObject *)&MethodHookType);
}
