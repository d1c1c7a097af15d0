/* engine_hooks._hotpath: the hooks' work that runs for every engine step and every streamed chunk,
 * in C.
 *
 * scan(): one pass over an engine step's outputs, on the engine's thread.
 *
 * A batching engine hands out one output object per running request at every step; the tracing
 * needs, of each, its request id, how many tokens it carries, and whether it holds anything rare
 * (events, a finish reason). Read through Python (operator.attrgetter over the list), that is
 * about 1,800 instructions per output; here the fields are read straight from the objects' slots
 * (the member descriptors of their class, checked once per call), about 60.
 *
 * scan(cls, id_member, count_member, rare_members, items, previous_ids)
 *   items:         a list of ``cls`` instances (anything else: TypeError, and the caller falls
 *                  back to Python)
 *   id_member:     the member descriptor of the request id
 *   count_member:  the member descriptor of the token list (its len() is the count)
 *   rare_members:  a tuple of member descriptors; an item any of which is not None is "rare"
 *   previous_ids:  the ids list this returned for the last step, or None
 * returns (ids, counts, rare):
 *   ids:    ``previous_ids`` itself when every id equals it in order (the same batch again), else a
 *           new list of the ids
 *   counts: None when every item carries exactly one token, else a list of ints
 *   rare:   None, or the list of the rare items
 *
 * It keeps no reference and has no state: the engine's objects are only read.
 *
 * TimedSend(send, record): what the HTTP server span's middleware hands the app as its
 * ASGI ``send``, called by vectorcall with each message: the time of each body chunk with a body
 * kept in a C array (no int object per chunk; ``chunks()`` gives them as an ``array('q')``, which
 * pickles as one bytes object), the response's start time and status set on ``record``
 * (``response_start_mono``, ``status``), then ``send(message)``'s awaitable handed back as it is:
 * no Python frame per chunk.
 * Times are CLOCK_MONOTONIC ns, as time.monotonic_ns() reads it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h>
#include <time.h>

/* The slot a member descriptor reads, or NULL (with TypeError set) when it is not an object slot
 * of ``cls``. */
static PyMemberDef *object_member(PyObject *descr, PyTypeObject *cls) {
    if (!PyObject_TypeCheck(descr, &PyMemberDescr_Type)) {
        PyErr_SetString(PyExc_TypeError, "expected a member descriptor");
        return NULL;
    }
    PyMemberDescrObject *d = (PyMemberDescrObject *)descr;
    PyMemberDef *m = d->d_member;
    if ((m->type != T_OBJECT && m->type != T_OBJECT_EX) || !PyType_IsSubtype(cls, PyDescr_TYPE(d))) {
        PyErr_SetString(PyExc_TypeError, "the member is not an object slot of the class");
        return NULL;
    }
    return m;
}

#define SLOT(obj, m) (*(PyObject **)((char *)(obj) + (m)->offset))

/* Two exact str objects with the same text (each step's ids are new objects: compared by value). */
static int same_str(PyObject *a, PyObject *b) {
    Py_ssize_t n = PyUnicode_GET_LENGTH(a);
    int kind = PyUnicode_KIND(a);
    return n == PyUnicode_GET_LENGTH(b) && kind == PyUnicode_KIND(b) &&
           memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), (size_t)n * kind) == 0;
}

static PyObject *scan(PyObject *self, PyObject *args) {
    PyObject *items, *cls_obj, *id_descr, *count_descr, *rare_descrs, *previous;
    if (!PyArg_ParseTuple(args, "O!OOO!O!O", &PyType_Type, &cls_obj, &id_descr, &count_descr, &PyTuple_Type,
                          &rare_descrs, &PyList_Type, &items, &previous))
        return NULL;
    PyTypeObject *cls = (PyTypeObject *)cls_obj;
    PyMemberDef *id_m = object_member(id_descr, cls);
    if (id_m == NULL) return NULL;
    PyMemberDef *count_m = object_member(count_descr, cls);
    if (count_m == NULL) return NULL;
    Py_ssize_t n_rare = PyTuple_GET_SIZE(rare_descrs);
    PyMemberDef *rare_m[8];
    if (n_rare > 8) {
        PyErr_SetString(PyExc_ValueError, "at most 8 rare members");
        return NULL;
    }
    for (Py_ssize_t j = 0; j < n_rare; j++) {
        rare_m[j] = object_member(PyTuple_GET_ITEM(rare_descrs, j), cls);
        if (rare_m[j] == NULL) return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(items);
    /* the same batch as the last step: compared first, so that a steady batch builds no list */
    int same = previous != Py_None && PyList_Check(previous) && PyList_GET_SIZE(previous) == n;
    PyObject *ids = NULL, *counts = NULL, *rare = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PyList_GET_ITEM(items, i);
        if (Py_TYPE(it) != cls) {
            PyErr_Format(PyExc_TypeError, "item %zd is a %.100s, not a %.100s", i, Py_TYPE(it)->tp_name,
                         cls->tp_name);
            goto fail;
        }
        PyObject *rid = SLOT(it, id_m), *toks = SLOT(it, count_m);
        if (rid == NULL || toks == NULL) {
            PyErr_SetString(PyExc_AttributeError, "an output without its request id or tokens");
            goto fail;
        }
        if (same) {
            PyObject *p = PyList_GET_ITEM(previous, i);
            if (p != rid) {
                int eq = PyUnicode_CheckExact(p) && PyUnicode_CheckExact(rid) ? same_str(p, rid)
                                                                             : PyObject_RichCompareBool(p, rid, Py_EQ);
                if (eq < 0) goto fail;
                if (!eq) {
                    same = 0;
                    ids = PyList_New(n);
                    if (ids == NULL) goto fail;
                    for (Py_ssize_t k = 0; k < i; k++) {  /* equal so far: the previous ones are these */
                        PyObject *q = SLOT(PyList_GET_ITEM(items, k), id_m);
                        Py_INCREF(q);
                        PyList_SET_ITEM(ids, k, q);
                    }
                }
            }
        } else if (ids == NULL) {
            ids = PyList_New(n);
            if (ids == NULL) goto fail;
        }
        if (!same) {
            Py_INCREF(rid);
            PyList_SET_ITEM(ids, i, rid);
        }
        Py_ssize_t c = PyList_CheckExact(toks) ? PyList_GET_SIZE(toks) : PyObject_Size(toks);
        if (c < 0) goto fail;
        if (counts == NULL && c != 1) {  /* the first item not of one token: every count from here */
            counts = PyList_New(0);
            if (counts == NULL) goto fail;
            for (Py_ssize_t k = 0; k < i; k++) {
                PyObject *one = PyLong_FromLong(1);
                if (one == NULL || PyList_Append(counts, one) < 0) {
                    Py_XDECREF(one);
                    goto fail;
                }
                Py_DECREF(one);
            }
        }
        if (counts != NULL) {
            PyObject *v = PyLong_FromSsize_t(c);
            if (v == NULL || PyList_Append(counts, v) < 0) {
                Py_XDECREF(v);
                goto fail;
            }
            Py_DECREF(v);
        }
        for (Py_ssize_t j = 0; j < n_rare; j++) {
            PyObject *v = SLOT(it, rare_m[j]);
            if (v != NULL && v != Py_None) {
                if (rare == NULL && (rare = PyList_New(0)) == NULL) goto fail;
                if (PyList_Append(rare, it) < 0) goto fail;
                break;
            }
        }
    }
    if (same) {
        ids = previous;
        Py_INCREF(ids);
    } else if (ids == NULL) {
        ids = PyList_New(0);
        if (ids == NULL) goto fail;
    }
    if (counts == NULL) {
        counts = Py_None;
        Py_INCREF(Py_None);
    }
    if (rare == NULL) {
        rare = Py_None;
        Py_INCREF(Py_None);
    }
    return Py_BuildValue("(NNN)", ids, counts, rare);
fail:
    Py_XDECREF(ids);
    Py_XDECREF(counts);
    Py_XDECREF(rare);
    return NULL;
}

static PyObject *s_type, *s_body, *s_status, *s_start, *s_chunk, *s_response_start_mono, *s_status_attr;
static PyObject *array_type; /* array.array */

/* ``v`` is the str ``interned``: the same object, or an exact str of the same text (an ASGI
 * message's type is a literal of the server's or the framework's: not interned where it has dots) */
static int is(PyObject *v, PyObject *interned) {
    return v == interned || (PyUnicode_CheckExact(v) && same_str(v, interned));
}

static long long monotonic(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* TimedSend(send, record): called as ``send(message)`` straight from the app's
 * ``await send(...)`` (vectorcall: no partial, no argument tuple), handing ``send``'s awaitable back
 * as it is. */
typedef struct {
    PyObject_HEAD PyObject *send, *record;
    vectorcallfunc vectorcall;
    long long *times; /* the body chunks' times, ``n`` of ``cap`` */
    Py_ssize_t n, cap;
} TimedSend;

/* The time of a body chunk with a body into ``t``'s array; the response's start time and status
 * onto its record. 0, or -1 with an exception set. */
static int note(TimedSend *t, PyObject *message) {
    if (!PyDict_Check(message)) return 0;
    PyObject *typ = PyDict_GetItemWithError(message, s_type); /* borrowed */
    if (typ == NULL) return PyErr_Occurred() ? -1 : 0;
    if (is(typ, s_chunk)) {
        PyObject *body = PyDict_GetItemWithError(message, s_body);
        if (body == NULL && PyErr_Occurred()) return -1;
        int has = body == NULL ? 0 : PyBytes_CheckExact(body) ? PyBytes_GET_SIZE(body) > 0 : PyObject_IsTrue(body);
        if (has <= 0) return has;
        if (t->n == t->cap) {
            Py_ssize_t cap = t->cap ? t->cap * 2 : 64;
            long long *grown = PyMem_Realloc(t->times, (size_t)cap * sizeof(long long));
            if (grown == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            t->times = grown;
            t->cap = cap;
        }
        t->times[t->n++] = monotonic();
        return 0;
    }
    if (is(typ, s_start)) {
        PyObject *ns = PyLong_FromLongLong(monotonic());
        if (ns == NULL) return -1;
        int bad = PyObject_SetAttr(t->record, s_response_start_mono, ns) < 0;
        Py_DECREF(ns);
        if (bad) return -1;
        PyObject *status = PyDict_GetItemWithError(message, s_status);
        if (status == NULL && PyErr_Occurred()) return -1;
        return PyObject_SetAttr(t->record, s_status_attr, status ? status : Py_None);
    }
    return 0;
}

static PyObject *ts_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    TimedSend *t = (TimedSend *)self;
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "send(message)");
        return NULL;
    }
    if (note(t, args[0]) < 0) return NULL;
    return PyObject_Vectorcall(t->send, args, nargsf, NULL);
}

/* chunks(): the body chunks' times so far, an array('q') of monotonic ns */
static PyObject *ts_chunks(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    TimedSend *t = (TimedSend *)self;
    if (t->n == 0) return PyObject_CallFunction(array_type, "s", "q"); /* "y#" of NULL would be None */
    return PyObject_CallFunction(array_type, "sy#", "q", (const char *)t->times, t->n * (Py_ssize_t)sizeof(long long));
}

static PyObject *ts_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *send, *record;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "TimedSend(send, record)");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "TimedSend", 2, 2, &send, &record)) return NULL;
    TimedSend *t = (TimedSend *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    Py_INCREF(send);
    Py_INCREF(record);
    t->send = send;
    t->record = record;
    t->vectorcall = ts_call;
    t->times = NULL;
    t->n = t->cap = 0;
    return (PyObject *)t;
}

static int ts_traverse(TimedSend *t, visitproc visit, void *arg) {
    Py_VISIT(t->send);
    Py_VISIT(t->record);
    return 0;
}

static int ts_clear(TimedSend *t) {
    Py_CLEAR(t->send);
    Py_CLEAR(t->record);
    return 0;
}

static void ts_dealloc(TimedSend *t) {
    PyObject_GC_UnTrack(t);
    ts_clear(t);
    PyMem_Free(t->times);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef ts_methods[] = {
    {"chunks", ts_chunks, METH_NOARGS, "chunks() -> array('q'): the body chunks' times so far (monotonic ns)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TimedSendType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engine_hooks._hotpath.TimedSend",
    .tp_basicsize = sizeof(TimedSend),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "TimedSend(send, record): an ASGI send that times the body chunks (see the source)",
    .tp_new = ts_new,
    .tp_traverse = (traverseproc)ts_traverse,
    .tp_clear = (inquiry)ts_clear,
    .tp_dealloc = (destructor)ts_dealloc,
    .tp_methods = ts_methods,
    .tp_vectorcall_offset = offsetof(TimedSend, vectorcall),
    .tp_call = PyVectorcall_Call,
};

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(cls, id_member, count_member, rare_members, items, previous_ids) -> (ids, counts, rare)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hotpath",
                                    "The hooks' per-step and per-chunk work in C (see the source).", -1, methods};

PyMODINIT_FUNC PyInit__hotpath(void) {
    s_type = PyUnicode_InternFromString("type");
    s_body = PyUnicode_InternFromString("body");
    s_status = PyUnicode_InternFromString("status");
    s_start = PyUnicode_InternFromString("http.response.start");
    s_chunk = PyUnicode_InternFromString("http.response.body");
    s_response_start_mono = PyUnicode_InternFromString("response_start_mono");
    s_status_attr = PyUnicode_InternFromString("status");
    if (!s_type || !s_body || !s_status || !s_start || !s_chunk || !s_response_start_mono || !s_status_attr)
        return NULL;
    PyObject *array_module = PyImport_ImportModule("array");
    if (array_module == NULL) return NULL;
    array_type = PyObject_GetAttrString(array_module, "array");
    Py_DECREF(array_module);
    if (array_type == NULL) return NULL;
    if (PyType_Ready(&TimedSendType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&TimedSendType);
    if (PyModule_AddObject(m, "TimedSend", (PyObject *)&TimedSendType) < 0) {
        Py_DECREF(&TimedSendType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
