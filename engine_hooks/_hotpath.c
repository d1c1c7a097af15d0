/* engine_hooks._hotpath: the hooks' work that runs for every engine step and every streamed chunk,
 * in C.
 *
 * Scanner: one pass over an engine step's outputs, on the engine's thread.
 *
 * A batching engine hands out one output object per running request at every step; the tracing
 * needs, of each, its request id, how many tokens it carries, and whether it holds anything rare
 * (events, a finish reason). Read through Python (operator.attrgetter over the list), that is
 * about 1,800 instructions per output; here the fields are read straight from the objects' slots
 * (the member descriptors of their class, checked once, when the scanner is made), about 60.
 *
 * Scanner(cls, id_member, count_member, rare_members)(items, previous_ids)
 *   id_member:     the member descriptor of the request id
 *   count_member:  the member descriptor of the token list (its len() is the count)
 *   rare_members:  a tuple of member descriptors; an item any of which is not None is "rare"
 *   items:         a list of ``cls`` instances (anything else: TypeError, and the caller falls
 *                  back to Python)
 *   previous_ids:  the ids list this returned for the last step, or None
 * returns (ids, counts, rare):
 *   ids:    ``previous_ids`` itself when every id equals it in order (the same batch again), else a
 *           new list of the ids
 *   counts: None when every item carries exactly one token, else a list of ints
 *   rare:   None, or the list of the rare items
 *
 * It keeps no reference to them and has no state: the engine's objects are only read.
 *
 * MethodHook: the traced method of EngineHooks.raw (vLLM's process_outputs, once a step) and of
 * EngineHooks.arrival_fields (add_request): the engine's method called with its caller's
 * arguments as they came, then the adapter's extractor, and the event recorded, with no Python
 * frame of ours in between.
 *
 * TimedSend(send): one HTTP response's times, for the HTTP server span's middleware: the time of
 * each body chunk with a body kept in a C array (no int object per chunk), the response's start
 * time and status; ``take()`` gives them (the chunks' times as one bytes object). Called as the
 * app's ASGI ``send`` (by vectorcall, with each message), it notes the message and hands back
 * ``send(message)``'s awaitable as it is: no Python frame per chunk, but an entry into the
 * interpreter from C for each.
 *
 * TimedTransport(transport): below ASGI, where the server is uvicorn: the connection's transport,
 * which uvicorn's protocol writes each response's head and each body chunk through, noting each
 * write in the ``timer`` (a TimedSend) the middleware sets for the response it traces, then
 * calling the transport's own ``write`` (C under uvloop): the app's send untouched, and no
 * Python frame of ours at all per chunk.
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

/* The scan itself: ``items`` a list, the members already checked to be object slots of ``cls``. */
static PyObject *scan_items(PyTypeObject *cls, PyMemberDef *id_m, PyMemberDef *count_m, PyMemberDef *const *rare_m,
                            Py_ssize_t n_rare, PyObject *items, PyObject *previous) {
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
    PyObject *out = PyTuple_New(3);
    if (out == NULL) goto fail;
    PyTuple_SET_ITEM(out, 0, ids);
    PyTuple_SET_ITEM(out, 1, counts);
    PyTuple_SET_ITEM(out, 2, rare);
    return out;
fail:
    Py_XDECREF(ids);
    Py_XDECREF(counts);
    Py_XDECREF(rare);
    return NULL;
}

#define MAX_RARE 8

/* Scanner(cls, id_member, count_member, rare_members): scan() with its class and members checked
 * once; called (by vectorcall) as scanner(items, previous_ids). */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyTypeObject *cls;
    PyObject *members; /* the descriptors, kept alive: their PyMemberDefs are read below */
    PyMemberDef *id_m, *count_m, *rare_m[MAX_RARE];
    Py_ssize_t n_rare;
} Scanner;

static PyObject *sc_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Scanner *sc = (Scanner *)self;
    if (PyVectorcall_NARGS(nargsf) != 2 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "Scanner(items, previous_ids): two positional arguments");
        return NULL;
    }
    if (!PyList_Check(args[0])) {
        PyErr_Format(PyExc_TypeError, "items is a %.100s, not a list", Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    return scan_items(sc->cls, sc->id_m, sc->count_m, sc->rare_m, sc->n_rare, args[0], args[1]);
}

static PyObject *sc_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *cls_obj, *id_descr, *count_descr, *rare_descrs;
    if (!PyArg_ParseTuple(args, "O!OOO!:Scanner", &PyType_Type, &cls_obj, &id_descr, &count_descr, &PyTuple_Type,
                          &rare_descrs))
        return NULL;
    PyTypeObject *cls = (PyTypeObject *)cls_obj;
    Py_ssize_t n_rare = PyTuple_GET_SIZE(rare_descrs);
    if (n_rare > MAX_RARE) {
        PyErr_SetString(PyExc_ValueError, "at most 8 rare members");
        return NULL;
    }
    PyMemberDef *id_m = object_member(id_descr, cls), *count_m = id_m ? object_member(count_descr, cls) : NULL;
    if (count_m == NULL) return NULL;
    Scanner *sc = (Scanner *)type->tp_alloc(type, 0);
    if (sc == NULL) return NULL;
    sc->vectorcall = sc_call;
    sc->id_m = id_m;
    sc->count_m = count_m;
    sc->n_rare = n_rare;
    for (Py_ssize_t j = 0; j < n_rare; j++) {
        if ((sc->rare_m[j] = object_member(PyTuple_GET_ITEM(rare_descrs, j), cls)) == NULL) {
            Py_DECREF(sc);
            return NULL;
        }
    }
    Py_INCREF(cls);
    sc->cls = cls;
    sc->members = Py_BuildValue("(OOO)", id_descr, count_descr, rare_descrs);
    if (sc->members == NULL) {
        Py_DECREF(sc);
        return NULL;
    }
    return (PyObject *)sc;
}

static void sc_dealloc(Scanner *sc) {
    Py_XDECREF(sc->cls);
    Py_XDECREF(sc->members);
    Py_TYPE(sc)->tp_free((PyObject *)sc);
}

static PyTypeObject ScannerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engine_hooks._hotpath.Scanner",
    .tp_basicsize = sizeof(Scanner),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Scanner(cls, id_member, count_member, rare_members)(items, previous_ids) -> (ids, counts, rare)",
    .tp_new = sc_new,
    .tp_dealloc = (destructor)sc_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Scanner, vectorcall),
};

static PyObject *s_type, *s_body, *s_status, *s_start, *s_chunk;

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

/* TimedSend(send): one HTTP response's times, and, called as ``send(message)`` straight from the
 * app's ``await send(...)`` (vectorcall: no partial, no argument tuple), the ASGI send that takes
 * them, handing ``send``'s awaitable back as it is. */
typedef struct {
    PyObject_HEAD PyObject *send;
    vectorcallfunc vectorcall;
    long long *times; /* the body chunks' times, ``n`` of ``cap`` */
    Py_ssize_t n, cap;
    long long started; /* the response's start, 0 before it */
    PyObject *status;  /* its status, NULL before it */
    int chunked;       /* (TimedTransport) the response is written in chunked transfer coding */
} TimedSend;

/* One more body chunk's time; 0, or -1 where the array could not grow (no exception set). */
static int add_chunk(TimedSend *t) {
    if (t->n == t->cap) {
        Py_ssize_t cap = t->cap ? t->cap * 2 : 64;
        long long *grown = PyMem_Realloc(t->times, (size_t)cap * sizeof(long long));
        if (grown == NULL) return -1;
        t->times = grown;
        t->cap = cap;
    }
    t->times[t->n++] = monotonic();
    return 0;
}

/* The time of a body chunk with a body; the response's start time and status. 0, or -1 with an
 * exception set. */
static int note(TimedSend *t, PyObject *message) {
    if (!PyDict_Check(message)) return 0;
    PyObject *typ = PyDict_GetItemWithError(message, s_type); /* borrowed */
    if (typ == NULL) return PyErr_Occurred() ? -1 : 0;
    if (is(typ, s_chunk)) {
        PyObject *body = PyDict_GetItemWithError(message, s_body);
        if (body == NULL && PyErr_Occurred()) return -1;
        int has = body == NULL ? 0 : PyBytes_CheckExact(body) ? PyBytes_GET_SIZE(body) > 0 : PyObject_IsTrue(body);
        if (has <= 0) return has;
        if (add_chunk(t) < 0) {
            PyErr_NoMemory();
            return -1;
        }
        return 0;
    }
    if (is(typ, s_start)) {
        t->started = monotonic();
        PyObject *status = PyDict_GetItemWithError(message, s_status);
        if (status == NULL && PyErr_Occurred()) return -1;
        Py_XINCREF(status);
        Py_XSETREF(t->status, status);
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

/* take(): (status or None, the response's start or None, the body chunks' times as the bytes of
 * int64 monotonic ns), what the record of the request holds */
static PyObject *ts_take(PyObject *self, PyObject *Py_UNUSED(ignored)) {
    TimedSend *t = (TimedSend *)self;
    PyObject *chunks = PyBytes_FromStringAndSize((const char *)t->times, t->n * (Py_ssize_t)sizeof(long long));
    if (chunks == NULL) return NULL;
    PyObject *started = t->started ? PyLong_FromLongLong(t->started) : Py_NewRef(Py_None);
    if (started == NULL) {
        Py_DECREF(chunks);
        return NULL;
    }
    PyObject *r = PyTuple_New(3);
    if (r == NULL) {
        Py_DECREF(chunks);
        Py_DECREF(started);
        return NULL;
    }
    PyTuple_SET_ITEM(r, 0, Py_NewRef(t->status ? t->status : Py_None));
    PyTuple_SET_ITEM(r, 1, started);
    PyTuple_SET_ITEM(r, 2, chunks);
    return r;
}

static PyObject *ts_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *send;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "TimedSend(send)");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "TimedSend", 1, 1, &send)) return NULL;
    TimedSend *t = (TimedSend *)type->tp_alloc(type, 0);
    if (t == NULL) return NULL;
    t->send = Py_NewRef(send);
    t->vectorcall = ts_call;
    return (PyObject *)t; /* the rest zeroed by tp_alloc */
}

static int ts_traverse(TimedSend *t, visitproc visit, void *arg) {
    Py_VISIT(t->send);
    Py_VISIT(t->status);
    return 0;
}

static int ts_clear(TimedSend *t) {
    Py_CLEAR(t->send);
    Py_CLEAR(t->status);
    return 0;
}

static void ts_dealloc(TimedSend *t) {
    PyObject_GC_UnTrack(t);
    ts_clear(t);
    PyMem_Free(t->times);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef ts_methods[] = {
    {"take", ts_take, METH_NOARGS,
     "take() -> (status, response_start_mono, chunk_times): None where not seen yet; the chunks' "
     "monotonic ns as the bytes of int64s"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TimedSendType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engine_hooks._hotpath.TimedSend",
    .tp_basicsize = sizeof(TimedSend),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "TimedSend(send): an ASGI send that times the response (see the source)",
    .tp_new = ts_new,
    .tp_traverse = (traverseproc)ts_traverse,
    .tp_clear = (inquiry)ts_clear,
    .tp_dealloc = (destructor)ts_dealloc,
    .tp_methods = ts_methods,
    .tp_vectorcall_offset = offsetof(TimedSend, vectorcall),
    .tp_call = PyVectorcall_Call,
};

/* ``p``'s first ``k`` bytes are ``lower`` (lowercase ASCII) in any ASCII case: HTTP field names. */
static int same_in_any_case(const char *p, const char *lower, Py_ssize_t k) {
    for (Py_ssize_t j = 0; j < k; j++) {
        char c = p[j];
        if ((c >= 'A' && c <= 'Z' ? c | 0x20 : c) != lower[j]) return 0;
    }
    return 1;
}

/* Whether an HTTP/1.1 response head names a transfer coding (then it is chunked: RFC 9112 6.1
 * has chunked last whenever the field is sent in a response that is not close-delimited). */
static int names_transfer_coding(const char *p, Py_ssize_t n) {
    static const char field[] = "\ntransfer-encoding:";
    const Py_ssize_t k = sizeof(field) - 1;
    for (Py_ssize_t i = 0; i + k <= n; i++)
        if (p[i] == '\n' && same_in_any_case(p + i, field, k)) return 1;
    return 0;
}

/* What one write of the server's says of the armed response: its head (the status line: the
 * response's start and status; an interim 1xx is not it), then each write with a body a chunk,
 * but for the chunked coding's last chunk alone ("0\r\n\r\n") and empty writes. Never raises. */
static void note_write(TimedSend *t, PyObject *data) {
    if (!PyBytes_CheckExact(data)) return;
    const char *p = PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    if (!t->started) {
        if (n < 12 || memcmp(p, "HTTP/", 5) != 0 || p[8] != ' ') return;
        int code = 0;
        for (int i = 9; i < 12; i++) {
            if (p[i] < '0' || p[i] > '9') return;
            code = code * 10 + (p[i] - '0');
        }
        if (code < 200) return; /* 100 Continue and the like come before the response */
        t->started = monotonic();
        PyObject *status = PyLong_FromLong(code);
        if (status == NULL) PyErr_Clear(); /* no memory: the span goes without its status */
        Py_XSETREF(t->status, status);
        t->chunked = names_transfer_coding(p, n);
        return;
    }
    if (n == 0 || (t->chunked && n == 5 && memcmp(p, "0\r\n\r\n", 5) == 0)) return;
    (void)add_chunk(t); /* no memory: the chunk goes untimed */
}

/* TimedTransport(transport): a server connection's transport, as its HTTP protocol writes through
 * it. ``write(data)`` notes each write in ``timer`` (a TimedSend, or None: nothing noted) and
 * hands it on with a C-to-C call (uvloop's write is C): a response's chunks timed below ASGI's
 * send, without a Python frame per chunk. Every other attribute is the transport's own. */
typedef struct {
    PyObject_HEAD PyObject *transport;
    PyObject *write; /* transport.write, bound once */
    PyObject *timer; /* NULL, or the TimedSend of the response being written */
    PyObject *own_write; /* this object's write, bound once: ``transport.write(...)`` allocates no
                          * bound method per call (the type's getattr is not the generic one) */
} TimedTransport;

static PyObject *s_write;
static PyMethodDef tt_methods[];

static PyObject *tt_write(PyObject *self, PyObject *data) {
    TimedTransport *tt = (TimedTransport *)self;
    if (tt->timer != NULL) note_write((TimedSend *)tt->timer, data);
    return PyObject_CallOneArg(tt->write, data);
}

static PyObject *tt_getattro(PyObject *self, PyObject *name) {
    if (name == s_write) return Py_NewRef(((TimedTransport *)self)->own_write);
    if (_PyType_Lookup(Py_TYPE(self), name) != NULL) return PyObject_GenericGetAttr(self, name);
    return PyObject_GetAttr(((TimedTransport *)self)->transport, name);
}

static int tt_setattro(PyObject *self, PyObject *name, PyObject *value) {
    if (_PyType_Lookup(Py_TYPE(self), name) != NULL) return PyObject_GenericSetAttr(self, name, value);
    return PyObject_SetAttr(((TimedTransport *)self)->transport, name, value);
}

static PyObject *tt_get_timer(PyObject *self, void *Py_UNUSED(closure)) {
    TimedTransport *tt = (TimedTransport *)self;
    return Py_NewRef(tt->timer ? tt->timer : Py_None);
}

static int tt_set_timer(PyObject *self, PyObject *value, void *Py_UNUSED(closure)) {
    TimedTransport *tt = (TimedTransport *)self;
    if (value == NULL || value == Py_None) {
        Py_CLEAR(tt->timer);
        return 0;
    }
    if (!PyObject_TypeCheck(value, &TimedSendType)) {
        PyErr_SetString(PyExc_TypeError, "timer: a TimedSend or None");
        return -1;
    }
    Py_XSETREF(tt->timer, Py_NewRef(value));
    return 0;
}

static PyObject *tt_get_transport(PyObject *self, void *Py_UNUSED(closure)) {
    return Py_NewRef(((TimedTransport *)self)->transport);
}

static PyObject *tt_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *transport;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "TimedTransport(transport)");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "TimedTransport", 1, 1, &transport)) return NULL;
    PyObject *write = PyObject_GetAttrString(transport, "write");
    if (write == NULL) return NULL;
    TimedTransport *tt = (TimedTransport *)type->tp_alloc(type, 0);
    if (tt == NULL) {
        Py_DECREF(write);
        return NULL;
    }
    tt->transport = Py_NewRef(transport);
    tt->write = write;
    tt->own_write = PyCFunction_New(tt_methods, (PyObject *)tt);
    if (tt->own_write == NULL) {
        Py_DECREF(tt);
        return NULL;
    }
    return (PyObject *)tt;
}

static int tt_traverse(TimedTransport *tt, visitproc visit, void *arg) {
    Py_VISIT(tt->transport);
    Py_VISIT(tt->write);
    Py_VISIT(tt->timer);
    Py_VISIT(tt->own_write);
    return 0;
}

static int tt_clear(TimedTransport *tt) {
    Py_CLEAR(tt->transport);
    Py_CLEAR(tt->write);
    Py_CLEAR(tt->timer);
    Py_CLEAR(tt->own_write);
    return 0;
}

static void tt_dealloc(TimedTransport *tt) {
    PyObject_GC_UnTrack(tt);
    tt_clear(tt);
    Py_TYPE(tt)->tp_free((PyObject *)tt);
}

static PyMethodDef tt_methods[] = { /* write first: tt_new binds it */
    {"write", tt_write, METH_O, "write(data): noted in the timer, then the transport's write(data)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef tt_getset[] = {
    {"timer", tt_get_timer, tt_set_timer, "the TimedSend the writes are noted in, or None", NULL},
    {"transport", tt_get_transport, NULL, "the transport written to", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject TimedTransportType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engine_hooks._hotpath.TimedTransport",
    .tp_basicsize = sizeof(TimedTransport),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "TimedTransport(transport): a transport whose writes are timed (see the source)",
    .tp_new = tt_new,
    .tp_getattro = tt_getattro,
    .tp_setattro = tt_setattro,
    .tp_traverse = (traverseproc)tt_traverse,
    .tp_clear = (inquiry)tt_clear,
    .tp_dealloc = (destructor)tt_dealloc,
    .tp_methods = tt_methods,
    .tp_getset = tt_getset,
};

/* The value of one hex digit, or -1. */
/* MethodHook(fn, extract, expander, owner, hook_failed, method_failed, kind, arrival): a traced
 * method, as engine_hooks.api's Python wrappers for EngineHooks.raw and EngineHooks.arrival_fields
 * are, in C: ``fn(*args, **kwargs)`` called with the caller's own arguments (vectorcall: no tuple or
 * dict built), then ``extract(result, *args, **kwargs)`` likewise, and one event recorded by
 * ``owner._rec(event)`` (looked up at each call: the owner's pipeline is made on first use, and may
 * be changed):
 *   raw (arrival false): ``(kind, monotonic ns, expander, extract's payload)``;
 *   arrival: extract gives ``(request id, start wall ns or None, input tokens, trace headers,
 *     attributes)``; nothing when the id is None, else ``(kind, monotonic ns, id, start, ...)``, the
 *     start placed on the monotonic clock as an age (``now - max(0, wall now - start)``).
 * An exception (an Exception) of extract or record goes to ``hook_failed(exc)`` and the caller
 * gets its result all the same (unless hook_failed raises: strict mode). One of fn's own goes to
 * ``method_failed(exc, args, kwargs)`` where that is not None, then on to the caller as it was.
 * A descriptor like a function (bound to the instance it is read from) with a __dict__ (what
 * functools.wraps and mark_hooked set). */
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

/* The exception being raised, taken off the thread (as PyErr_Fetch gives it: the caller owns the
 * three, or gives them back with PyErr_Restore), normalised and its traceback set on it. */
static void fetch_normalized(PyObject **type, PyObject **value, PyObject **tb) {
    PyErr_Fetch(type, value, tb);
    PyErr_NormalizeException(type, value, tb);
    if (*tb != NULL && *value != NULL) PyException_SetTraceback(*value, *tb);
}

static PyObject *mh_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    MethodHook *h = (MethodHook *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *res = PyObject_Vectorcall(h->fn, args, nargsf, kwnames);
    if (res == NULL) {
        if (h->method_failed == Py_None) return NULL;
        PyObject *type, *value, *tb;
        fetch_normalized(&type, &value, &tb);
        PyObject *a = PyTuple_New(nargs), *k = PyDict_New(), *r = NULL;
        if (a != NULL && k != NULL) {
            for (Py_ssize_t i = 0; i < nargs; i++) {
                Py_INCREF(args[i]);
                PyTuple_SET_ITEM(a, i, args[i]);
            }
            int ok = 1;
            for (Py_ssize_t i = 0; ok && kwnames != NULL && i < PyTuple_GET_SIZE(kwnames); i++)
                ok = PyDict_SetItem(k, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) == 0;
            if (ok) r = PyObject_CallFunctionObjArgs(h->method_failed, value, a, k, NULL);
        }
        Py_XDECREF(a);
        Py_XDECREF(k);
        if (r == NULL) { /* strict: the hook's failure goes on instead */
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            return NULL;
        }
        Py_DECREF(r);
        PyErr_Restore(type, value, tb); /* the method's own exception, as it was */
        return NULL;
    }
    PyObject *x = call_extract(h->extract, res, args, nargs, kwnames), *ev = NULL, *ok = NULL;
    if (x != NULL) {
        long long now = monotonic();
        PyObject *t = PyLong_FromLongLong(now);
        if (t != NULL && !h->arrival) {
            ev = PyTuple_Pack(4, h->kind, t, h->expander, x);
        } else if (t != NULL) {
            if (!PyTuple_Check(x) || PyTuple_GET_SIZE(x) != 5) {
                PyErr_SetString(PyExc_TypeError, "an arrival's fields: (request id, start, input tokens, headers, attrs)");
            } else if (PyTuple_GET_ITEM(x, 0) == Py_None) {
                ev = Py_None; /* refused without an id: nothing to trace */
                Py_INCREF(ev);
            } else {
                PyObject *start = PyTuple_GET_ITEM(x, 1), *placed = NULL;
                if (start == Py_None) {
                    placed = Py_None;
                    Py_INCREF(placed);
                } else {
                    PyObject *as_int = PyNumber_Long(start); /* an int, a float, a numpy integer */
                    long long s0 = as_int != NULL ? PyLong_AsLongLong(as_int) : -1;
                    Py_XDECREF(as_int);
                    if (!(s0 == -1 && PyErr_Occurred())) {
                        struct timespec ts;
                        clock_gettime(CLOCK_REALTIME, &ts);
                        long long age = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec - s0;
                        placed = PyLong_FromLongLong(now - (age > 0 ? age : 0));
                    }
                }
                if (placed != NULL) {
                    ev = PyTuple_Pack(7, h->kind, t, PyTuple_GET_ITEM(x, 0), placed, PyTuple_GET_ITEM(x, 2),
                                      PyTuple_GET_ITEM(x, 3), PyTuple_GET_ITEM(x, 4));
                    Py_DECREF(placed);
                }
            }
        }
        Py_XDECREF(t);
        Py_DECREF(x);
    }
    if (ev == Py_None) {
        Py_DECREF(ev);
        return res;
    }
    if (ev != NULL) {
        PyObject *record = PyObject_GetAttr(h->owner, s_rec);
        if (record != NULL) {
            ok = PyObject_CallOneArg(record, ev);
            Py_DECREF(record);
        }
        Py_DECREF(ev);
    }
    if (ok != NULL) {
        Py_DECREF(ok);
        return res;
    }
    if (!PyErr_ExceptionMatches(PyExc_Exception)) { /* KeyboardInterrupt, SystemExit: not ours to keep */
        Py_DECREF(res);
        return NULL;
    }
    PyObject *type, *value, *tb;
    fetch_normalized(&type, &value, &tb);
    PyObject *r = value != NULL ? PyObject_CallOneArg(h->hook_failed, value) : NULL;
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
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
    for (int i = 0; i < 7; i++) {
        Py_INCREF(v[i]);
        *slots[i] = v[i];
    }
    return (PyObject *)h;
}

static PyObject *mh_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
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
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engine_hooks._hotpath.MethodHook",
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

static int all_zero(const unsigned char *p, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
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
    if (parents || drop_state) {
        Py_ssize_t w = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *h = PyList_GET_ITEM(headers, i);
            PyObject *k = PyTuple_GET_ITEM(h, 0);
            Py_ssize_t kn = PyBytes_GET_SIZE(k);
            const char *kp = PyBytes_AS_STRING(k);
            int drop = (kn == 11 && same_in_any_case(kp, "traceparent", 11)) ||
                       (drop_state && kn == 10 && same_in_any_case(kp, "tracestate", 10));
            if (drop) continue;
            if (w != i) {
                Py_INCREF(h);
                PyList_SetItem(headers, w, h); /* steals the new reference, drops the old item's */
            }
            w++;
        }
        if (PyList_SetSlice(headers, w, n, NULL) < 0) {
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

static PyMethodDef methods[] = {
    {"take_traceparent", take_traceparent, METH_O,
     "take_traceparent(headers) -> None | (trace id, span id, flags): the caller's traceparent, taken out (see the source)"},
    {"traceparent", (PyCFunction)(void (*)(void))traceparent, METH_FASTCALL,
     "traceparent(trace_id, span_id, flags) -> bytes: a W3C traceparent value"},
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
    s_write = PyUnicode_InternFromString("write");
    s_rec = PyUnicode_InternFromString("_rec");
    if (!s_type || !s_body || !s_status || !s_start || !s_chunk || !s_write || !s_rec) return NULL;
    if (PyType_Ready(&ScannerType) < 0 || PyType_Ready(&MethodHookType) < 0 || PyType_Ready(&TimedSendType) < 0 || PyType_Ready(&TimedTransportType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Scanner", (PyObject *)&ScannerType) < 0 ||
        PyModule_AddObjectRef(m, "MethodHook", (PyObject *)&MethodHookType) < 0 ||
        PyModule_AddObjectRef(m, "TimedSend", (PyObject *)&TimedSendType) < 0 ||
        PyModule_AddObjectRef(m, "TimedTransport", (PyObject *)&TimedTransportType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
