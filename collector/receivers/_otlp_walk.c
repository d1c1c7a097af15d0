/* Fast walk of an OTLP ExportTraceServiceRequest (protobuf wire format) for the collector.
 *
 * walk(body, names, keys, resource_key, invalid) -> (total, rejected, first_error, spans)
 *
 *   names:        dict str -> int: the span names to return, with the code to return them under
 *   keys:         dict str -> int: the attribute keys to read, with their slot (0 .. len(keys)-1)
 *   resource_key: the resource attribute returned with each span (service.name)
 *   invalid:      the object returned for an attribute of a type the collector does not read
 *
 * Each returned span is a tuple
 *   (trace_id bytes, span_id bytes, parent_span_id bytes, code, kind, start_ns, end_ns,
 *    status_code, resource_value, slot 0, ..., slot n-1)
 * An attribute value is str / bool / int / float, or bytes of native int64 for an array whose
 * elements are all integers, or `invalid`; None where absent. Spans whose names are not in `names`
 * are only counted; spans of interest with bad ids, an end before their start or past int64 ns are counted as
 * rejected, the first such reason in first_error. This is the same result, tuple for tuple, as
 * collector.receivers.decode.walk_message over the parsed message (tests check it).
 *
 * Anything this walker does not handle exactly as protobuf's own parser would (malformed input,
 * groups, a oneof or message field given twice, invalid UTF-8 in a value it returns) makes it
 * return None: the caller then parses with protobuf, which decides. Every read is bounds-checked;
 * there is no recursion.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define FALLBACK (-1) /* not handled here: let protobuf decide (no exception set) */
#define PYERR (-2)    /* a Python exception is set */

typedef struct {
    const uint8_t *p, *end;
} reader;

typedef struct {
    uint32_t num, wt;
    uint64_t v;           /* varint / fixed value */
    const uint8_t *data;  /* length-delimited payload */
    Py_ssize_t len;
} field;

static int read_varint(reader *r, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (r->p >= r->end) return FALLBACK;
        uint8_t b = *r->p++;
        if (shift == 63 && b > 1) return FALLBACK;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return FALLBACK;
}

static uint64_t le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Next field; 1: got one, 0: end of buffer, FALLBACK: malformed or a group. */
static int next_field(reader *r, field *f) {
    if (r->p >= r->end) return 0;
    uint64_t tag;
    if (read_varint(r, &tag)) return FALLBACK;
    if ((tag >> 3) == 0 || (tag >> 3) > 0x1fffffff) return FALLBACK;
    f->num = (uint32_t)(tag >> 3);
    f->wt = (uint32_t)(tag & 7);
    switch (f->wt) {
    case 0:
        return read_varint(r, &f->v) ? FALLBACK : 1;
    case 1:
        if (r->end - r->p < 8) return FALLBACK;
        f->v = le64(r->p);
        r->p += 8;
        return 1;
    case 2: {
        uint64_t n;
        if (read_varint(r, &n)) return FALLBACK;
        if (n > (uint64_t)(r->end - r->p)) return FALLBACK;
        f->data = r->p;
        f->len = (Py_ssize_t)n;
        r->p += n;
        return 1;
    }
    case 5:
        if (r->end - r->p < 4) return FALLBACK;
        f->v = (uint64_t)r->p[0] | ((uint64_t)r->p[1] << 8) | ((uint64_t)r->p[2] << 16) | ((uint64_t)r->p[3] << 24);
        r->p += 4;
        return 1;
    default:
        return FALLBACK; /* groups (3, 4) and invalid wire types */
    }
}

/* A name table: utf-8 bytes -> code / slot. */
typedef struct {
    const char *s;
    Py_ssize_t n;
    long code;
} entry;

typedef struct {
    entry *e;
    Py_ssize_t n;
} table;

static long lookup(const table *t, const uint8_t *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < t->n; i++)
        if (t->e[i].n == n && memcmp(t->e[i].s, s, (size_t)n) == 0) return t->e[i].code;
    return -1;
}

static int make_table(PyObject *dict, table *t, long max_code) {
    t->n = 0;
    t->e = PyMem_Calloc((size_t)PyDict_Size(dict) + 1, sizeof(entry));
    if (!t->e) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(dict, &pos, &k, &v)) {
        if (!PyUnicode_Check(k) || !PyLong_Check(v)) {
            PyErr_SetString(PyExc_TypeError, "name tables map str to int");
            return -1;
        }
        entry *e = &t->e[t->n++];
        e->s = PyUnicode_AsUTF8AndSize(k, &e->n); /* borrowed from the key, which the dict holds */
        if (!e->s) return -1;
        e->code = PyLong_AsLong(v);
        if (e->code < 0 || e->code > max_code) {
            PyErr_SetString(PyExc_ValueError, "code or slot out of range");
            return -1;
        }
    }
    return 0;
}

/* The wire type of AnyValue's field `num` (1..7). */
static uint32_t anyvalue_wire_type(uint32_t num) { return (num == 2 || num == 3) ? 0 : (num == 4 ? 1 : 2); }

/* ArrayValue of integers -> bytes of native int64; `invalid` if any element is not an integer.
 * Elements are nearly always `0a <n> 18 <varint of n-1 bytes>`: that form is read directly, and
 * anything else element by element as general fields. One pass: the output is sized for the most
 * elements the bytes can hold (2 bytes each), then shrunk. */
static int int_array(const uint8_t *data, Py_ssize_t len, PyObject *invalid, PyObject **out) {
    PyObject *b = PyBytes_FromStringAndSize(NULL, (len / 2) * 8);
    if (!b) return PYERR;
    int64_t *dst = (int64_t *)PyBytes_AS_STRING(b);
    Py_ssize_t i = 0;
    reader r = {data, data + len};
    int rc = 0;
    while (r.p < r.end) {
        const uint8_t *p = r.p;
        if (r.end - p >= 4 && p[0] == 0x0a && p[1] >= 2 && p[1] <= 11 && p[2] == 0x18 && r.end - p >= 2 + p[1]) {
            /* the common form: one element, int_value only */
            const uint8_t *q = p + 3, *qe = p + 2 + p[1];
            uint64_t v = 0;
            int shift = 0, ok = 0;
            while (q < qe) {
                uint8_t c = *q++;
                v |= (uint64_t)(c & 0x7f) << shift;
                shift += 7;
                if (!(c & 0x80)) {
                    ok = (q == qe) && !(shift == 70 && c > 1);
                    break;
                }
            }
            if (ok) {
                dst[i++] = (int64_t)v;
                r.p = qe;
                continue;
            }
        }
        field f;
        if ((rc = next_field(&r, &f)) != 1) break;
        rc = 0; /* a field read: nothing pending (an unknown field skipped must not end the walk) */
        if (f.num != 1) continue;
        if (f.wt != 2) {
            rc = FALLBACK;
            break;
        }
        /* one AnyValue: the oneof's last member wins */
        reader e = {f.data, f.data + f.len};
        field g;
        int which = 0;
        uint64_t iv = 0;
        while ((rc = next_field(&e, &g)) == 1) {
            if (g.num >= 1 && g.num <= 7) {
                if (g.wt != anyvalue_wire_type(g.num)) {
                    rc = FALLBACK;
                    break;
                }
                which = (int)g.num;
                if (g.num == 3) iv = g.v;
            }
        }
        if (rc) break;
        if (which != 3) {
            Py_DECREF(b);
            Py_INCREF(invalid);
            *out = invalid;
            return 0;
        }
        dst[i++] = (int64_t)iv;
    }
    if (rc) {
        Py_DECREF(b);
        return rc;
    }
    if (_PyBytes_Resize(&b, i * 8)) return PYERR;
    *out = b;
    return 0;
}

/* One AnyValue -> Python value (new reference in *out). */
static int any_value(const uint8_t *data, Py_ssize_t len, PyObject *invalid, PyObject **out) {
    reader r = {data, data + len};
    field f, last = {0};
    int rc, seen_msg = 0;
    while ((rc = next_field(&r, &f)) == 1) {
        if (f.num < 1 || f.num > 7) continue; /* unknown field */
        if (f.wt != anyvalue_wire_type(f.num)) return FALLBACK;
        if (f.num == 5 || f.num == 6) {
            if (seen_msg++) return FALLBACK; /* protobuf would merge the two messages */
        }
        last = f;
    }
    if (rc) return rc;
    switch (last.num) {
    case 0:
        Py_INCREF(Py_None);
        *out = Py_None;
        return 0;
    case 1:
        *out = PyUnicode_DecodeUTF8((const char *)last.data, last.len, NULL);
        if (!*out) {
            PyErr_Clear();
            return FALLBACK; /* invalid UTF-8: protobuf rejects the payload */
        }
        return 0;
    case 2:
        *out = PyBool_FromLong(last.v != 0);
        return 0;
    case 3:
        *out = PyLong_FromLongLong((long long)(int64_t)last.v);
        return *out ? 0 : PYERR;
    case 4: {
        double d;
        memcpy(&d, &last.v, 8);
        *out = PyFloat_FromDouble(d);
        return *out ? 0 : PYERR;
    }
    case 5:
        return int_array(last.data, last.len, invalid, out);
    default: /* kvlist, bytes: not read by the collector */
        Py_INCREF(invalid);
        *out = invalid;
        return 0;
    }
}

/* One KeyValue: if its key is in `keys`, put its value into slots[slot] (last wins). */
static int key_value(const uint8_t *data, Py_ssize_t len, const table *keys, PyObject *invalid,
                     PyObject **slots) {
    reader r = {data, data + len};
    field f;
    int rc, nvalue = 0;
    const uint8_t *key = NULL, *val = NULL;
    Py_ssize_t klen = 0, vlen = 0;
    while ((rc = next_field(&r, &f)) == 1) {
        if (f.num == 1) {
            if (f.wt != 2) return FALLBACK;
            key = f.data;
            klen = f.len;
        } else if (f.num == 2) {
            if (f.wt != 2) return FALLBACK;
            if (nvalue++) return FALLBACK; /* protobuf would merge the two values */
            val = f.data;
            vlen = f.len;
        }
    }
    if (rc) return rc;
    long slot = lookup(keys, key ? key : (const uint8_t *)"", klen);
    if (slot < 0) return 0;
    PyObject *v;
    if (val) {
        rc = any_value(val, vlen, invalid, &v);
        if (rc) return rc;
    } else {
        Py_INCREF(Py_None);
        v = Py_None;
    }
    Py_XSETREF(slots[slot], v);
    return 0;
}

static int all_zero(const uint8_t *p, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

typedef struct {
    const table *names, *keys;
    PyObject *invalid, *resource_value, *spans, *first_error;
    Py_ssize_t total, rejected, nkeys;
    PyObject *last_trace_id; /* spans of a trace often come together: they share one bytes object */
} walk_state;

#define NFIXED 9

static int span(walk_state *st, const uint8_t *data, Py_ssize_t len) {
    reader r = {data, data + len};
    field f;
    int rc;
    const uint8_t *tid = NULL, *sid = NULL, *pid = NULL, *name = NULL;
    Py_ssize_t tlen = 0, slen = 0, plen = 0, nlen = 0;
    uint64_t kind = 0, start = 0, end = 0, status = 0;
    int has_attrs = 0;
    st->total++;
    while ((rc = next_field(&r, &f)) == 1) {
        switch (f.num) {
        case 1: case 2: case 4: case 5: case 9: case 15:
            if (f.wt != 2) return FALLBACK;
            break;
        case 6:
            if (f.wt != 0) return FALLBACK;
            break;
        case 7: case 8:
            if (f.wt != 1) return FALLBACK;
            break;
        }
        switch (f.num) {
        case 1: tid = f.data; tlen = f.len; break;
        case 2: sid = f.data; slen = f.len; break;
        case 4: pid = f.data; plen = f.len; break;
        case 5: name = f.data; nlen = f.len; break;
        case 6: kind = f.v; break;
        case 7: start = f.v; break;
        case 8: end = f.v; break;
        case 9: has_attrs = 1; break;
        case 15: { /* Status: code is field 3; messages given twice merge (last code wins) */
            reader s = {f.data, f.data + f.len};
            field g;
            int src;
            while ((src = next_field(&s, &g)) == 1)
                if (g.num == 3) {
                    if (g.wt != 0) return FALLBACK;
                    status = g.v;
                }
            if (src) return src;
            break;
        }
        }
    }
    if (rc) return rc;
    long code = lookup(st->names, name ? name : (const uint8_t *)"", nlen);
    if (code < 0) return 0;
    const char *why = NULL;
    if (tlen != 16 || slen != 8 || all_zero(tid, 16) || all_zero(sid, 8))
        why = "has an invalid trace or span id";
    else if (end < start)
        why = "ends before it starts";
    else if (end > (uint64_t)INT64_MAX)
        why = "ends past the year 2262";
    if (why) {
        st->rejected++;
        if (st->first_error == Py_None) {
            PyObject *n = PyUnicode_DecodeUTF8((const char *)(name ? name : (const uint8_t *)""), nlen, NULL);
            if (!n) return PYERR;
            PyObject *msg = PyUnicode_FromFormat("span %R %s", n, why);
            Py_DECREF(n);
            if (!msg) return PYERR;
            Py_SETREF(st->first_error, msg);
        }
        return 0;
    }
    PyObject *t = PyTuple_New(NFIXED + st->nkeys);
    if (!t) return PYERR;
    PyObject **slots = &PyTuple_GET_ITEM(t, NFIXED);
    for (Py_ssize_t i = 0; i < st->nkeys; i++) {
        Py_INCREF(Py_None);
        slots[i] = Py_None;
    }
    if (has_attrs && st->nkeys) {
        r.p = data;
        while ((rc = next_field(&r, &f)) == 1)
            if (f.num == 9 && (rc = key_value(f.data, f.len, st->keys, st->invalid, slots)))
                break;
        if (rc) {
            Py_DECREF(t);
            return rc;
        }
    }
    PyObject *tid_obj;
    if (st->last_trace_id && memcmp(PyBytes_AS_STRING(st->last_trace_id), tid, 16) == 0) {
        tid_obj = st->last_trace_id;
        Py_INCREF(tid_obj);
    } else {
        tid_obj = PyBytes_FromStringAndSize((const char *)tid, 16);
        if (tid_obj) {
            Py_INCREF(tid_obj);
            Py_XSETREF(st->last_trace_id, tid_obj);
        }
    }
    PyObject *items[NFIXED] = {
        tid_obj,
        PyBytes_FromStringAndSize((const char *)sid, 8),
        PyBytes_FromStringAndSize((const char *)(pid ? pid : (const uint8_t *)""), plen),
        PyLong_FromLong(code),
        PyLong_FromLong((long)(int32_t)kind),
        PyLong_FromUnsignedLongLong(start),
        PyLong_FromUnsignedLongLong(end),
        PyLong_FromLong((long)(int32_t)status),
        st->resource_value,
    };
    Py_INCREF(st->resource_value);
    for (int i = 0; i < NFIXED; i++) {
        if (!items[i]) {
            for (int j = 0; j < NFIXED; j++) Py_XDECREF(items[j]);
            Py_DECREF(t);
            return PYERR;
        }
    }
    for (int i = 0; i < NFIXED; i++) PyTuple_SET_ITEM(t, i, items[i]);
    rc = PyList_Append(st->spans, t);
    Py_DECREF(t);
    return rc ? PYERR : 0;
}

typedef int (*visit_fn)(void *ctx, const uint8_t *data, Py_ssize_t len);

/* visit(ctx, bytes) for each length-delimited field `inner` of each length-delimited field
 * `outer` of the buffer, in order; stops at the first non-zero return. */
static int each_nested(const uint8_t *data, Py_ssize_t len, uint32_t outer, uint32_t inner, visit_fn visit,
                       void *ctx) {
    reader r = {data, data + len};
    field f;
    int rc;
    while ((rc = next_field(&r, &f)) == 1) {
        if (f.num != outer) continue;
        if (f.wt != 2) return FALLBACK;
        reader rr = {f.data, f.data + f.len};
        field g;
        while ((rc = next_field(&rr, &g)) == 1) {
            if (g.num != inner) continue;
            if (g.wt != 2) return FALLBACK;
            if ((rc = visit(ctx, g.data, g.len))) return rc;
        }
        if (rc) return rc;
    }
    return rc;
}

typedef struct {
    const table *key;
    PyObject *invalid, **value;
} resource_attr;

static int visit_resource_attr(void *ctx, const uint8_t *data, Py_ssize_t len) {
    resource_attr *a = ctx;
    return key_value(data, len, a->key, a->invalid, a->value);
}

static int visit_span(void *ctx, const uint8_t *data, Py_ssize_t len) { return span(ctx, data, len); }

/* ResourceSpans: the resource attribute first (resource messages given twice merge: their
 * attributes concatenate, the last occurrence wins), then the spans of every scope. */
static int resource_spans(walk_state *st, const uint8_t *data, Py_ssize_t len, const table *rkey) {
    PyObject *rv = Py_None;
    Py_INCREF(rv);
    resource_attr a = {rkey, st->invalid, &rv};
    int rc = each_nested(data, len, 1, 1, visit_resource_attr, &a); /* Resource.attributes */
    if (!rc) {
        st->resource_value = rv;
        rc = each_nested(data, len, 2, 2, visit_span, st); /* ScopeSpans.spans */
        st->resource_value = NULL;
    }
    Py_DECREF(rv);
    return rc;
}

static PyObject *walk(PyObject *self, PyObject *args) {
    Py_buffer body;
    PyObject *names_d, *keys_d, *rkey_s, *invalid;
    if (!PyArg_ParseTuple(args, "y*O!O!UO", &body, &PyDict_Type, &names_d, &PyDict_Type, &keys_d, &rkey_s, &invalid))
        return NULL;
    table names = {0}, keys = {0}, rkey = {0};
    entry rk;
    PyObject *result = NULL;
    walk_state st = {&names, &keys, invalid, NULL, NULL, Py_None, 0, 0, PyDict_Size(keys_d), NULL};
    Py_INCREF(Py_None);
    if (make_table(names_d, &names, 0x7fffffff) || make_table(keys_d, &keys, st.nkeys - 1)) goto done;
    rk.s = PyUnicode_AsUTF8AndSize(rkey_s, &rk.n);
    if (!rk.s) goto done;
    rk.code = 0;
    rkey.e = &rk;
    rkey.n = 1;
    st.spans = PyList_New(0);
    if (!st.spans) goto done;
    reader r = {body.buf, (const uint8_t *)body.buf + body.len};
    field f;
    int rc;
    while ((rc = next_field(&r, &f)) == 1) {
        if (f.num != 1) continue;
        if (f.wt != 2) {
            rc = FALLBACK;
            break;
        }
        if ((rc = resource_spans(&st, f.data, f.len, &rkey))) break;
    }
    if (rc == PYERR) goto done;
    if (rc == FALLBACK) {
        Py_INCREF(Py_None);
        result = Py_None;
        goto done;
    }
    result = Py_BuildValue("nnOO", st.total, st.rejected, st.first_error, st.spans);
done:
    Py_XDECREF(st.spans);
    Py_XDECREF(st.first_error);
    Py_XDECREF(st.last_trace_id);
    PyMem_Free(names.e);
    PyMem_Free(keys.e);
    PyBuffer_Release(&body);
    return result;
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, "walk(body, names, keys, resource_key, invalid) -> (total, rejected, first_error, spans) or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_otlp_walk", "Fast OTLP span walk (see decode.py).", -1, methods};

PyMODINIT_FUNC PyInit__otlp_walk(void) { return PyModule_Create(&module); }
