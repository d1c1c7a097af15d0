/* Fast walk of an OTLP ExportTraceServiceRequest (protobuf wire format) for the collector.
 *
 * walk(body, names, keys, resource_key, invalid) -> (total, rejected, first_error, spans)
 *
 *   names:        dict str -> int: the span names to return, with the code to return them under
 *                 (a name ending in '*': every span name that begins with the rest of it)
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
 * Before walking, the whole body is checked against the message schema that set_schema() gave (the
 * installed opentelemetry-proto's descriptors, see decode.py), as protobuf's parser checks it: every
 * field well formed, every string field valid UTF-8 (strictly: no surrogates, no overlong forms),
 * every nested message, read or not, checked the same way. Anything this walker does not handle
 * exactly as protobuf's own parser would (malformed input, groups, a known field with another wire
 * type, a oneof or message field given twice, nesting deeper than MAX_DEPTH, no schema set) makes it
 * return None: the caller then parses with protobuf, which decides. Every read is bounds-checked;
 * the only recursion is the schema check's, bounded by MAX_DEPTH.
 */
#include "../../otel_llm/csrc/otel_llm_c.h"
#include <stdint.h>

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

static inline __attribute__((always_inline)) int read_varint(reader *r, uint64_t *out) {
    if (r->p < r->end && !(*r->p & 0x80)) { /* one byte: most tags, lengths and values */
        *out = *r->p++;
        return 0;
    }
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

/* A tag or a length: protobuf takes at most 5 bytes for either (a 32-bit varint, padded or not). */
static inline __attribute__((always_inline)) int read_varint32(reader *r, uint64_t *out) {
    const uint8_t *start = r->p;
    if (read_varint(r, out)) return FALLBACK;
    if (r->p - start > 5 || *out > 0xffffffffULL) return FALLBACK;
    return 0;
}

static uint64_t le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* Next field; 1: got one, 0: end of buffer, FALLBACK: malformed or a group. */
static inline __attribute__((always_inline)) int next_field(reader *r, field *f) {
    if (r->p >= r->end) return 0;
    uint64_t tag;
    if (read_varint32(r, &tag)) return FALLBACK;
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
        if (read_varint32(r, &n)) return FALLBACK;
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

/* -- the schema check --------------------------------------------------------------------------- */

/* Field kinds of the schema (set_schema's second tuple member). */
enum { K_UNKNOWN = 0, K_VARINT = 1, K_FIXED64 = 2, K_FIXED32 = 3, K_STRING = 4, K_BYTES = 5, K_MESSAGE = 6, K_DEFER = 7 };

/* Messages nested deeper than this (the request itself is depth 1) go to protobuf, whose limit is
 * 100: a payload protobuf rejects for its depth is never walked here. */
#define MAX_DEPTH 64

typedef struct {
    uint8_t kind;
    uint16_t sub; /* message index, for K_MESSAGE */
} fdesc;

typedef struct {
    uint32_t n; /* fields 0 .. n-1 */
    fdesc *f;
} mdesc;

static mdesc *schema = NULL;
static Py_ssize_t nschema = 0;

/* Strict UTF-8 (RFC 3629, as protobuf's utf8_range): no overlong forms, no surrogates, nothing
 * above U+10FFFF. ASCII eight bytes at a time. */
static int utf8_valid(const uint8_t *s, Py_ssize_t n) {
    const uint8_t *e = s + n;
    while (s < e) {
        while (e - s >= 8) {
            uint64_t w;
            memcpy(&w, s, 8);
            if (w & 0x8080808080808080ULL) break;
            s += 8;
        }
        if (s >= e) break;
        uint8_t c = *s;
        if (c < 0x80) {
            s++;
            continue;
        }
        int need;
        uint8_t lo = 0x80, hi = 0xbf;
        if (c >= 0xc2 && c <= 0xdf) need = 1;
        else if (c == 0xe0) { need = 2; lo = 0xa0; }
        else if (c >= 0xe1 && c <= 0xec) need = 2;
        else if (c == 0xed) { need = 2; hi = 0x9f; }
        else if (c >= 0xee && c <= 0xef) need = 2;
        else if (c == 0xf0) { need = 3; lo = 0x90; }
        else if (c >= 0xf1 && c <= 0xf3) need = 3;
        else if (c == 0xf4) { need = 3; hi = 0x8f; }
        else return 0;
        if (e - s <= need) return 0;
        if (s[1] < lo || s[1] > hi) return 0;
        for (int i = 2; i <= need; i++)
            if (s[i] < 0x80 || s[i] > 0xbf) return 0;
        s += need + 1;
    }
    return 1;
}

/* Whether a message is one varint field of the schema with a one-byte tag and nothing else (the
 * elements of a token-event array: `18 <varint>`): valid as it is, no need to walk it. */
static inline int single_varint(const mdesc *md, const uint8_t *p, Py_ssize_t n) {
    if (n < 2 || n > 11 || (p[0] & 0x87) != 0) return 0; /* a one-byte tag of wire type 0 */
    uint32_t num = p[0] >> 3;
    if (num >= md->n || md->f[num].kind != K_VARINT) return 0;
    for (Py_ssize_t i = 1; i < n; i++)
        if (!(p[i] & 0x80)) return i == n - 1;
    return 0;
}

/* 0: the message (and everything in it) is as protobuf would accept it; FALLBACK otherwise. */
static int check_message(Py_ssize_t m, const uint8_t *data, Py_ssize_t len, int depth) {
    if (depth > MAX_DEPTH) return FALLBACK;
    const mdesc *md = &schema[m];
    reader r = {data, data + len};
    field f = {0};
    int rc;
    for (;;) {
        const uint8_t *p = r.p;
        /* the common case first: a small embedded message that is one varint (an array element) */
        if (r.end - p >= 4 && (p[0] & 0x87) == 2 && p[1] < 0x80 && r.end - p >= 2 + p[1]) {
            uint32_t num = p[0] >> 3;
            if (num < md->n && md->f[num].kind == K_MESSAGE && single_varint(&schema[md->f[num].sub], p + 2, p[1])) {
                r.p = p + 2 + p[1];
                continue;
            }
        }
        if ((rc = next_field(&r, &f)) != 1) break;
        if (f.num >= md->n) continue; /* unknown: next_field checked its framing */
        const fdesc *d = &md->f[f.num];
        switch (d->kind) {
        case K_UNKNOWN:
            break;
        case K_VARINT:
            if (f.wt != 0) return FALLBACK;
            break;
        case K_FIXED64:
            if (f.wt != 1) return FALLBACK;
            break;
        case K_FIXED32:
            if (f.wt != 5) return FALLBACK;
            break;
        case K_STRING:
            if (f.wt != 2 || !utf8_valid(f.data, f.len)) return FALLBACK;
            break;
        case K_BYTES:
            if (f.wt != 2) return FALLBACK;
            break;
        case K_MESSAGE:
            if (f.wt != 2) return FALLBACK;
            if (single_varint(&schema[d->sub], f.data, f.len)) break; /* e.g. an int AnyValue: valid */
            if ((rc = check_message(d->sub, f.data, f.len, depth + 1))) return rc;
            break;
        default:
            return FALLBACK;
        }
    }
    return rc;
}

static void free_schema(void) {
    for (Py_ssize_t i = 0; i < nschema; i++) PyMem_Free(schema[i].f);
    PyMem_Free(schema);
    schema = NULL;
    nschema = 0;
}

/* set_schema(messages): messages[i] is a list of (field number, kind, message index) for message
 * i; message 0 is ExportTraceServiceRequest. */
static PyObject *set_schema(PyObject *self, PyObject *arg) {
    if (!PyList_Check(arg) || PyList_GET_SIZE(arg) == 0 || PyList_GET_SIZE(arg) > 0xffff) {
        PyErr_SetString(PyExc_TypeError, "set_schema takes a non-empty list of field lists");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    mdesc *ms = PyMem_Calloc((size_t)n, sizeof(mdesc));
    if (!ms) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *fields = PyList_GET_ITEM(arg, i);
        if (!PyList_Check(fields)) goto bad;
        uint32_t top = 0;
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(fields); j++) {
            long num, kind, sub;
            if (!PyArg_ParseTuple(PyList_GET_ITEM(fields, j), "lll", &num, &kind, &sub)) goto fail;
            if (num < 1 || num > 100000 || kind < 0 || kind > K_DEFER || sub < 0 || sub >= n) goto bad;
            if ((uint32_t)num + 1 > top) top = (uint32_t)num + 1;
        }
        ms[i].n = top;
        ms[i].f = PyMem_Calloc(top ? top : 1, sizeof(fdesc));
        if (!ms[i].f) {
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(fields); j++) {
            long num, kind, sub;
            PyArg_ParseTuple(PyList_GET_ITEM(fields, j), "lll", &num, &kind, &sub);
            ms[i].f[num].kind = (uint8_t)kind;
            ms[i].f[num].sub = (uint16_t)sub;
        }
    }
    free_schema();
    schema = ms;
    nschema = n;
    Py_RETURN_NONE;
bad:
    PyErr_SetString(PyExc_ValueError, "set_schema: bad field entry");
fail:
    for (Py_ssize_t i = 0; i < n; i++) PyMem_Free(ms[i].f);
    PyMem_Free(ms);
    return NULL;
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

/* The code of a name: an entry equal to it, else an entry ending in '*' that it begins with (the
 * rest of the entry, e.g. "Req *" for SGLang's "Req 1a2b3c4d"); -1 for none. */
static long lookup(const table *t, const uint8_t *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < t->n; i++)
        if (t->e[i].n == n && memcmp(t->e[i].s, s, (size_t)n) == 0) return t->e[i].code;
    for (Py_ssize_t i = 0; i < t->n; i++) {
        const entry *e = &t->e[i];
        if (e->n > 0 && e->s[e->n - 1] == '*' && n >= e->n - 1 && memcmp(e->s, s, (size_t)(e->n - 1)) == 0)
            return e->code;
    }
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

/* AnyValue's oneof: fields 1..8 (8: string_value_strindex, an int32 index into a profiles string
 * table, which the collector does not read). The wire type of member `num`. */
#define ANY_LAST 8
static uint32_t anyvalue_wire_type(uint32_t num) { return (num == 2 || num == 3 || num == 8) ? 0 : (num == 4 ? 1 : 2); }

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
        field f = {0};
        if ((rc = next_field(&r, &f)) != 1) break;
        rc = 0; /* a field read: nothing pending (an unknown field skipped must not end the walk) */
        if (f.num != 1) continue;
        if (f.wt != 2) {
            rc = FALLBACK;
            break;
        }
        /* one AnyValue: the oneof's last member wins */
        reader e = {f.data, f.data + f.len};
        field g = {0};
        int which = 0;
        uint64_t iv = 0;
        while ((rc = next_field(&e, &g)) == 1) {
            if (g.num >= 1 && g.num <= ANY_LAST) {
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
    field f = {0}, last = {0};
    int rc, seen_msg = 0;
    while ((rc = next_field(&r, &f)) == 1) {
        if (f.num < 1 || f.num > ANY_LAST) continue; /* unknown field */
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
    default: /* kvlist, bytes, string table index: not read by the collector */
        Py_INCREF(invalid);
        *out = invalid;
        return 0;
    }
}

/* One KeyValue: if its key is in `keys`, put its value into slots[slot] (last wins). */
static int key_value(const uint8_t *data, Py_ssize_t len, const table *keys, PyObject *invalid,
                     PyObject **slots) {
    reader r = {data, data + len};
    field f = {0};
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

typedef struct {
    const table *names, *keys;
    PyObject *invalid, *resource_value, *spans, *first_error;
    Py_ssize_t total, rejected, nkeys;
    PyObject *last_trace_id; /* spans of a trace often come together: they share one bytes object */
} walk_state;

#define NFIXED 9

static int span(walk_state *st, const uint8_t *data, Py_ssize_t len) {
    reader r = {data, data + len};
    field f = {0};
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
            field g = {0};
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
    field f = {0};
    int rc;
    while ((rc = next_field(&r, &f)) == 1) {
        if (f.num != outer) continue;
        if (f.wt != 2) return FALLBACK;
        reader rr = {f.data, f.data + f.len};
        field g = {0};
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
    field f = {0};
    int rc = schema ? check_message(0, body.buf, body.len, 1) : FALLBACK;
    if (rc == FALLBACK) {
        Py_INCREF(Py_None);
        result = Py_None;
        goto done;
    }
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
    {"set_schema", set_schema, METH_O, "set_schema(messages): the message schema the body is checked against (see decode.py)"},
    {NULL, NULL, 0, NULL},
};

/* Multi-phase initialisation (PEP 489). The message schema set_schema gives is kept in a static
 * variable: the module is for the main interpreter only (from 3.12 it says so, and a subinterpreter
 * that imports it gets an ImportError). */
static PyModuleDef_Slot slots[] = {
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_otlp_walk",
    .m_doc = "Fast OTLP span walk (see decode.py).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC PyInit__otlp_walk(void) { return PyModuleDef_Init(&module); }
