/* The HTTP server span's response times (engine_hooks/asgi.py), at ASGI's send or below it.
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
 * Python frame of ours at all per chunk. */
#include "hotpath.h"

static PyObject *s_type, *s_body, *s_status, *s_start, *s_chunk;

/* ``v`` is the str ``interned``: the same object, or an exact str of the same text (an ASGI
 * message's type is a literal of the server's or the framework's: not interned where it has dots) */
static int is(PyObject *v, PyObject *interned) {
    return v == interned || (PyUnicode_CheckExact(v) && same_str(v, interned));
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
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engine_hooks.hot_path._hotpath.TimedSend",
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
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engine_hooks.hot_path._hotpath.TimedTransport",
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

int hotpath_http_timing_init(PyObject *module) {
    if (s_type == NULL) {
        s_type = PyUnicode_InternFromString("type");
        s_body = PyUnicode_InternFromString("body");
        s_status = PyUnicode_InternFromString("status");
        s_start = PyUnicode_InternFromString("http.response.start");
        s_chunk = PyUnicode_InternFromString("http.response.body");
        s_write = PyUnicode_InternFromString("write");
        if (!s_type || !s_body || !s_status || !s_start || !s_chunk || !s_write) return -1;
    }
    if (PyType_Ready(&TimedSendType) < 0 || PyType_Ready(&TimedTransportType) < 0) return -1;
    if (PyModule_AddObjectRef(module, "TimedSend", (PyObject *)&TimedSendType) < 0) return -1;
    return PyModule_AddObjectRef(module, "TimedTransport", (PyObject *)&TimedTransportType);
}
