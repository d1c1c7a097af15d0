"""Rewrites of OTLP protobuf payloads at the wire level, for differential tests and the fuzzer.

A payload is parsed into a tree of fields with the collector's own wire schema
(:func:`collector.receivers.decode.wire_schema`, from the installed descriptors), then rewritten the
ways a hostile or merely unusual sender writes protobuf, most of which protobuf's parser accepts:
unknown fields of every wire type (groups included), padded varints (tags, lengths, values), fields
reordered, repeated, or a message split into two occurrences that protobuf merges, a known field
under another wire type, invalid UTF-8 (stray continuation bytes, surrogates, overlong forms) in a
string field, key-value lists nested near and past protobuf's depth limit, AnyValue's
``string_value_strindex``, and raw byte flips and cuts. The serializer writes the tree back.
"""

from __future__ import annotations

import random

from collector.receivers.decode import wire_schema

SCHEMA = wire_schema()
KINDS = [{num: (kind, sub) for num, kind, sub in fields} for fields in SCHEMA]
STRING, MESSAGE = 4, 6
ANYVALUE = next(i for i, k in enumerate(KINDS) if set(k) >= {1, 2, 3, 4, 5, 6, 7} and k[6][0] == MESSAGE)
KVLIST = KINDS[ANYVALUE][6][1]
KEYVALUE = KINDS[KVLIST][1][1]
SCOPESPANS = KINDS[1][2][1]
SPAN = KINDS[SCOPESPANS][2][1]
SPLITTABLE = {1, SCOPESPANS, KINDS[1][1][1], KINDS[SPAN][15][1]}  # ResourceSpans, ScopeSpans, Resource, Status
BAD_UTF8 = [b"\x80", b"\xc0\x80", b"\xed\xa0\x80", b"\xf5\x80\x80\x80", b"\xe2\x82", b"a\xff", b"\xf4\x90\x80\x80"]


class Field:
    """One field on the wire: number, wire type, and a value (int for varints, bytes for fixed
    and raw length-delimited, list[Field] for a parsed message), with its varint padding."""

    __slots__ = ("msg", "num", "pad_len", "pad_tag", "pad_val", "value", "wt")

    def __init__(self, num: int, wt: int, value, msg: int | None = None):
        self.num, self.wt, self.value, self.msg = num, wt, value, msg
        self.pad_tag = self.pad_len = self.pad_val = 0

    def copy(self) -> Field:
        f = Field(self.num, self.wt, [c.copy() for c in self.value] if self.msg is not None else self.value, self.msg)
        f.pad_tag, f.pad_len, f.pad_val = self.pad_tag, self.pad_len, self.pad_val
        return f


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("bad varint")
        b = buf[i]
        i += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, i


def parse(buf: bytes, msg: int = 0) -> list[Field]:
    """The fields of message ``msg`` (schema index); raises ValueError on malformed input."""
    out, i = [], 0
    while i < len(buf):
        tag, i = _varint(buf, i)
        num, wt = tag >> 3, tag & 7
        if wt == 0:
            v, i = _varint(buf, i)
        elif wt == 1:
            v, i = buf[i : i + 8], i + 8
        elif wt == 5:
            v, i = buf[i : i + 4], i + 4
        elif wt == 2:
            n, i = _varint(buf, i)
            v, i = buf[i : i + n], i + n
        else:
            raise ValueError("group")
        if i > len(buf):
            raise ValueError("truncated")
        kind, sub = KINDS[msg].get(num, (0, 0))
        if wt == 2 and kind == MESSAGE:
            out.append(Field(num, wt, parse(v, sub), sub))
        else:
            out.append(Field(num, wt, v))
    return out


def _enc_varint(v: int, pad: int = 0) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            break
    room = 10 - len(out)
    if pad > 0 and room > 0:  # redundant continuation bytes: same value, longer encoding
        pad = min(pad, room)
        out[-1] |= 0x80
        out += b"\x80" * (pad - 1) + b"\x00"
    return bytes(out)


def serialize(fields: list[Field]) -> bytes:
    out = bytearray()
    for f in fields:
        out += _enc_varint(f.num << 3 | f.wt, f.pad_tag)
        if f.wt == 0:
            out += _enc_varint(f.value, f.pad_val)
        elif f.wt in (1, 5):
            out += f.value
        elif f.wt == 2:
            body = serialize(f.value) if f.msg is not None else f.value
            out += _enc_varint(len(body), f.pad_len) + body
        elif f.wt == 3:  # a group: its fields, then the end tag
            out += serialize(f.value) + _enc_varint(f.num << 3 | 4)
    return bytes(out)


def _all(fields: list[Field], acc: list | None = None, parent: list | None = None) -> list:
    """Every (field, containing list) in the tree."""
    acc = [] if acc is None else acc
    for f in fields:
        acc.append((f, fields))
        if f.msg is not None:
            _all(f.value, acc, fields)
    return acc


def _messages(fields: list[Field]) -> list[tuple[list[Field], int]]:
    out = [(fields, 0)]
    for f, _ in _all(fields):
        if f.msg is not None:
            out.append((f.value, f.msg))
    return out


def _unknown_num(msg: int, rnd: random.Random) -> int:
    while True:
        n = rnd.choice([rnd.randint(1, 20), rnd.randint(17, 2000), rnd.randint(2**20, 2**29 - 1)])
        if n not in KINDS[msg]:
            return n


def _random_unknown(msg: int, rnd: random.Random, groups: bool) -> Field:
    num = _unknown_num(msg, rnd)
    wt = rnd.choice([0, 1, 2, 5, 3] if groups else [0, 1, 2, 5])
    if wt == 0:
        return Field(num, 0, rnd.choice([0, 1, 2**63, 2**64 - 1, rnd.getrandbits(64)]))
    if wt == 1:
        return Field(num, 1, rnd.randbytes(8))
    if wt == 5:
        return Field(num, 5, rnd.randbytes(4))
    if wt == 2:
        return Field(num, 2, rnd.randbytes(rnd.randint(0, 12)))
    return Field(num, 3, [Field(_unknown_num(msg, rnd), 0, 1)])  # group (protobuf keeps it as unknown)


def _nested_kvlist(depth: int) -> Field:
    """An AnyValue field (KeyValue.value) holding key-value lists ``depth`` deep."""
    value = [Field(3, 0, 7)]
    for _ in range(depth):
        kv = [Field(1, 2, b"k"), Field(2, 2, value, ANYVALUE)]
        value = [Field(6, 2, [Field(1, 2, kv, KEYVALUE)], KVLIST)]
    return Field(2, 2, value, ANYVALUE)


# rewrites protobuf accepts and that the C walk must take without deferring
BENIGN = ("unknown", "pad", "split_repeated")
ALL = (*BENIGN, "overpad", "group", "reorder", "repeat", "split", "wrong_wire_type", "bad_utf8", "nest", "strindex")


def rewrite(tree: list[Field], op: str, rnd: random.Random) -> None:
    """Apply one rewrite ``op`` (one of ALL) somewhere in the tree, in place."""
    nodes = _all(tree)
    msgs = _messages(tree)
    if op in ("unknown", "group"):
        fields, m = rnd.choice(msgs)
        fields.insert(rnd.randint(0, len(fields)), _random_unknown(m, rnd, op == "group"))
    elif op in ("pad", "overpad") and nodes:
        # protobuf takes tags and lengths of at most 5 bytes, values of up to 10: "pad" stays
        # within that, "overpad" goes past it
        f, _ = rnd.choice(nodes)
        which = rnd.choice(["pad_tag", "pad_len", "pad_val"])
        if which == "pad_tag":
            used, room = len(_enc_varint(f.num << 3)), 5
        elif which == "pad_len" and f.wt == 2:
            used, room = len(_enc_varint(len(serialize(f.value) if f.msg is not None else f.value))), 5
        elif which == "pad_val" and f.wt == 0:
            used, room = len(_enc_varint(f.value)), 10
        else:
            return
        if op == "pad":
            if used >= room:
                return
            pad = rnd.randint(1, room - used)
        else:
            pad = rnd.randint(room - used + 1, 10)
        setattr(f, which, pad)
    elif op == "reorder":
        fields, _ = rnd.choice(msgs)
        rnd.shuffle(fields)
    elif op == "repeat" and nodes:
        f, parent = rnd.choice(nodes)
        parent.insert(rnd.randint(0, len(parent)), f.copy())
    elif op in ("split", "split_repeated"):
        # a message field written twice, its subfields divided between the two. For a singular
        # field protobuf merges the two; for an element of a repeated field they are two elements.
        # split_repeated only splits what the C walk reads without deferring: the elements of
        # resource_spans and scope_spans, a Resource, a Status.
        cands = [(f, p) for f, p in nodes if f.msg is not None and len(f.value) >= 2]
        if op == "split_repeated":
            cands = [(f, p) for f, p in cands if f.msg in SPLITTABLE]
        if cands:
            f, parent = rnd.choice(cands)
            k = rnd.randint(1, len(f.value) - 1)
            i = next(j for j, g in enumerate(parent) if g is f)
            parent[i : i + 1] = [Field(f.num, 2, f.value[:k], f.msg), Field(f.num, 2, f.value[k:], f.msg)]
    elif op == "wrong_wire_type" and nodes:
        f, parent = rnd.choice(nodes)
        wt = rnd.choice([w for w in (0, 1, 2, 5) if w != f.wt])
        g = {
            0: Field(f.num, 0, 5),
            1: Field(f.num, 1, bytes(8)),
            2: Field(f.num, 2, b"xy"),
            5: Field(f.num, 5, bytes(4)),
        }
        parent[next(j for j, h in enumerate(parent) if h is f)] = g[wt]
    elif op == "bad_utf8":
        strings = [(f, p) for f, p in nodes if f.msg is None and f.wt == 2 and _kind_in(tree, f) == STRING]
        if strings:
            f, _ = rnd.choice(strings)
            bad = rnd.choice(BAD_UTF8)
            i = rnd.randint(0, len(f.value))
            f.value = f.value[:i] + bad + f.value[i:]
    elif op == "nest":
        kvs = [f for f, _ in nodes if f.msg == KEYVALUE]
        if kvs:
            kv = rnd.choice(kvs)
            depth = rnd.choice([1, 5, 20, 29, 30, 31, 32, 33, 40])
            kv.value = [c for c in kv.value if c.num != 2] + [_nested_kvlist(depth)]
    elif op == "strindex":
        anys = [f for f, _ in nodes if f.msg == ANYVALUE]
        if anys:
            a = rnd.choice(anys)
            a.value.insert(rnd.randint(0, len(a.value)), Field(8, 0, rnd.choice([0, 1, 3, 2**31])))


def _kind_in(tree: list[Field], target: Field) -> int:
    """The schema kind of a field, found by walking from the root with message indexes."""

    def find(fields, msg):
        for f in fields:
            if f is target:
                return KINDS[msg].get(f.num, (0, 0))[0]
            if f.msg is not None:
                k = find(f.value, f.msg)
                if k is not None:
                    return k
        return None

    return find(tree, 0) or 0


def mutate(body: bytes, rnd: random.Random, ops: tuple[str, ...] = ALL, n: int | None = None) -> bytes:
    """``body`` with 1..4 rewrites from ``ops`` (and, when ``ops`` is ALL, sometimes a raw byte
    flip or cut on top)."""
    try:
        tree = parse(body)
    except ValueError:
        tree = None
    if tree is not None:
        for _ in range(n or rnd.randint(1, 4)):
            rewrite(tree, rnd.choice(ops), rnd)
        body = serialize(tree)
    if ops is ALL and rnd.random() < 0.15 and body:
        b = bytearray(body)
        for _ in range(rnd.randint(1, 3)):
            b[rnd.randrange(len(b))] = rnd.randrange(256)
        body = bytes(b[: rnd.randint(0, len(b))] if rnd.random() < 0.3 else b)
    return body
