/* Scanner: one pass over an engine step's outputs, on the engine's thread.
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
 * It keeps no reference to them and has no state: the engine's objects are only read. Python code
 * can run during the scan (a token list's ``__len__``, an id's ``__eq__``) and change the lists or
 * the objects: the scan holds its own references to what it reads across such a call, and where a
 * list's length changed it stops with TypeError (the caller then reads the lists through Python). */
#include "hotpath.h"

/* The slot a member descriptor reads, or NULL (with TypeError set) when it is not an object slot
 * of ``cls``. */
static PyMemberDef *object_member(PyObject *descr, PyTypeObject *cls) {
    if (!PyObject_TypeCheck(descr, &PyMemberDescr_Type)) {
        PyErr_SetString(PyExc_TypeError, "expected a member descriptor");
        return NULL;
    }
    PyMemberDescrObject *d = (PyMemberDescrObject *)descr;
    PyMemberDef *m = d->d_member;
    if ((m->type != OTEL_LLM_T_OBJECT && m->type != OTEL_LLM_T_OBJECT_EX) ||
        !PyType_IsSubtype(cls, PyDescr_TYPE(d))) {
        PyErr_SetString(PyExc_TypeError, "the member is not an object slot of the class");
        return NULL;
    }
    return m;
}

#define SLOT(obj, m) (*(PyObject **)((char *)(obj) + (m)->offset))

/* The id of ``items[k]`` (a new reference), read again for the ids list: TypeError where the item
 * is no longer a ``cls`` with its id (Python code run by the scan replaced it). */
static PyObject *id_again(PyObject *items, Py_ssize_t k, PyTypeObject *cls, PyMemberDef *id_m) {
    PyObject *it = PyList_GET_ITEM(items, k);
    PyObject *rid = Py_TYPE(it) == cls ? SLOT(it, id_m) : NULL;
    if (rid == NULL) {
        PyErr_SetString(PyExc_TypeError, "an output changed during the scan");
        return NULL;
    }
    return Py_NewRef(rid);
}

/* 0 where ``list`` still has ``n`` items; else -1 with TypeError set. */
static int same_length(PyObject *list, Py_ssize_t n) {
    if (PyList_GET_SIZE(list) == n) return 0;
    PyErr_SetString(PyExc_TypeError, "a list changed size during the scan");
    return -1;
}

/* Whether ``p`` (the previous step's id) equals ``rid``: 1, 0, or -1 with an exception set. */
static int same_id(PyObject *p, PyObject *rid) {
    if (p == rid) return 1;
    if (PyUnicode_CheckExact(p) && PyUnicode_CheckExact(rid)) return same_str(p, rid);
    Py_INCREF(p); /* __eq__ may drop the lists' references */
    int eq = PyObject_RichCompareBool(p, rid, Py_EQ);
    Py_DECREF(p);
    return eq;
}

/* Appends ``c`` to ``counts``, the step's token counts, made at the first item not of one token
 * (``i`` items of one token before it): 0, or -1 with an exception set. */
static int add_count(PyObject **counts, Py_ssize_t i, Py_ssize_t c) {
    if (*counts == NULL) {
        if (c == 1) return 0;
        if ((*counts = PyList_New(0)) == NULL) return -1;
        for (Py_ssize_t k = 0; k < i; k++) {
            PyObject *one = PyLong_FromLong(1);
            if (one == NULL || PyList_Append(*counts, one) < 0) {
                Py_XDECREF(one);
                return -1;
            }
            Py_DECREF(one);
        }
    }
    PyObject *v = PyLong_FromSsize_t(c);
    if (v == NULL || PyList_Append(*counts, v) < 0) {
        Py_XDECREF(v);
        return -1;
    }
    Py_DECREF(v);
    return 0;
}

/* One item of the scan: its id into ``ids`` (or still the same as ``previous``), its count, and
 * the item into ``rare`` where it is rare. The item, its id and its tokens are held for the call:
 * 0, or -1 with an exception set. */
static int scan_one(PyTypeObject *cls, PyMemberDef *id_m, PyMemberDef *count_m, PyMemberDef *const *rare_m,
                    Py_ssize_t n_rare, PyObject *items, PyObject *previous, Py_ssize_t i, Py_ssize_t n, int *same,
                    PyObject **ids, PyObject **counts, PyObject **rare) {
    if (same_length(items, n) < 0 || (*same && same_length(previous, n) < 0)) return -1;
    PyObject *it = PyList_GET_ITEM(items, i);
    if (Py_TYPE(it) != cls) {
        PyErr_Format(PyExc_TypeError, "item %zd is a %.100s, not a %.100s", i, Py_TYPE(it)->tp_name, cls->tp_name);
        return -1;
    }
    PyObject *rid = SLOT(it, id_m), *toks = SLOT(it, count_m);
    if (rid == NULL || toks == NULL) {
        PyErr_SetString(PyExc_AttributeError, "an output without its request id or tokens");
        return -1;
    }
    Py_INCREF(it);
    Py_INCREF(rid);
    Py_INCREF(toks);
    int rc = -1;
    if (*same) {
        int eq = same_id(PyList_GET_ITEM(previous, i), rid);
        if (eq < 0 || same_length(items, n) < 0) goto done;
        if (!eq) { /* equal so far: the ids before this one are read again */
            *same = 0;
            if ((*ids = PyList_New(n)) == NULL) goto done;
            for (Py_ssize_t k = 0; k < i; k++) {
                PyObject *q = id_again(items, k, cls, id_m);
                if (q == NULL) goto done;
                PyList_SET_ITEM(*ids, k, q);
            }
        }
    } else if (*ids == NULL && (*ids = PyList_New(n)) == NULL) {
        goto done;
    }
    if (!*same) PyList_SET_ITEM(*ids, i, Py_NewRef(rid));
    Py_ssize_t c = PyList_CheckExact(toks) ? PyList_GET_SIZE(toks) : PyObject_Size(toks);
    if (c < 0 || add_count(counts, i, c) < 0) goto done;
    for (Py_ssize_t j = 0; j < n_rare; j++) {
        PyObject *v = SLOT(it, rare_m[j]);
        if (v != NULL && v != Py_None) {
            if (*rare == NULL && (*rare = PyList_New(0)) == NULL) goto done;
            if (PyList_Append(*rare, it) < 0) goto done;
            break;
        }
    }
    rc = 0;
done:
    Py_DECREF(toks);
    Py_DECREF(rid);
    Py_DECREF(it);
    return rc;
}

/* The scan itself: ``items`` a list, the members already checked to be object slots of ``cls``. */
static PyObject *scan_items(PyTypeObject *cls, PyMemberDef *id_m, PyMemberDef *count_m, PyMemberDef *const *rare_m,
                            Py_ssize_t n_rare, PyObject *items, PyObject *previous) {
    Py_ssize_t n = PyList_GET_SIZE(items);
    /* the same batch as the last step: compared first, so that a steady batch builds no list */
    int same = previous != Py_None && PyList_Check(previous) && PyList_GET_SIZE(previous) == n;
    PyObject *ids = NULL, *counts = NULL, *rare = NULL;
    Py_INCREF(items);
    Py_INCREF(previous);
    for (Py_ssize_t i = 0; i < n; i++)
        if (scan_one(cls, id_m, count_m, rare_m, n_rare, items, previous, i, n, &same, &ids, &counts, &rare) < 0)
            goto fail;
    if (same) {
        ids = Py_NewRef(previous);
    } else if (ids == NULL && (ids = PyList_New(0)) == NULL) {
        goto fail;
    }
    PyObject *out = PyTuple_New(3);
    if (out == NULL) goto fail;
    PyTuple_SET_ITEM(out, 0, ids);
    PyTuple_SET_ITEM(out, 1, counts ? counts : Py_NewRef(Py_None));
    PyTuple_SET_ITEM(out, 2, rare ? rare : Py_NewRef(Py_None));
    Py_DECREF(items);
    Py_DECREF(previous);
    return out;
fail:
    Py_XDECREF(ids);
    Py_XDECREF(counts);
    Py_XDECREF(rare);
    Py_DECREF(items);
    Py_DECREF(previous);
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
    sc->cls = (PyTypeObject *)Py_NewRef(cls);
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
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "engine_hooks.hot_path._hotpath.Scanner",
    .tp_basicsize = sizeof(Scanner),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "Scanner(cls, id_member, count_member, rare_members)(items, previous_ids) -> (ids, counts, rare)",
    .tp_new = sc_new,
    .tp_dealloc = (destructor)sc_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Scanner, vectorcall),
};

int hotpath_scan_init(PyObject *module) {
    if (PyType_Ready(&ScannerType) < 0) return -1;
    return PyModule_AddObjectRef(module, "Scanner", (PyObject *)&ScannerType);
}
