"""Bulk decoding of OTLP integer-array attributes (the token-event arrays).

Reading an ``ArrayValue`` of ``int_value`` elements through protobuf's Python objects costs a
wrapper object per element. Instead the receiver keeps each array's serialized bytes
(:class:`RawIntArray`) and derivation decodes a whole batch at once with protobuf's own C parser:

An ``ArrayValue`` is a run of field-1 chunks, one per element, each holding the element's
``AnyValue`` bytes; for an integer element those bytes are ``0x18 <varint>`` (field 3, the
value). Parsed as a *packed* ``repeated int64`` field 1, that same run decodes to
``[24, v0, 24, v1, ...]``. The blobs of a batch are joined with a separator chunk that decodes to
``[0, 0]``, so one parse yields every array, and the pairs tell the arrays apart (first of a pair
0: separator; 24: a value; anything else: that array holds something other than integers, and it
is decoded the slow way).
"""
from __future__ import annotations

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message_factory import GetMessageClass
from opentelemetry.proto.common.v1.common_pb2 import ArrayValue


class RawIntArray(bytes):
    """The serialized bytes of one ``ArrayValue`` attribute, decoded later in bulk."""


def _make_class():
    fdp = descriptor_pb2.FileDescriptorProto(name="otel_llm_packed_int64.proto", package="otel_llm", syntax="proto3")
    msg = fdp.message_type.add(name="PackedInt64")
    msg.field.add(name="v", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64,
                  label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return GetMessageClass(pool.FindMessageTypeByName("otel_llm.PackedInt64"))


_Packed = _make_class()
_SEP = b"\x0a\x02\x00\x00"  # a chunk that decodes to the pair (0, 0)
_INT_TAG = 24  # 0x18: AnyValue.int_value, varint


def _slow(blob: bytes) -> np.ndarray | None:
    arr = ArrayValue()
    try:
        arr.ParseFromString(blob)
    except Exception:  # noqa: BLE001
        return None
    out = []
    for v in arr.values:
        if v.WhichOneof("value") != "int_value":
            return None
        out.append(v.int_value)
    return np.asarray(out, dtype=np.int64)


def decode_int_arrays(blobs: list[bytes]) -> list[np.ndarray | None]:
    """Decode many serialized int ``ArrayValue``\\ s; ``None`` for a blob that is not one."""
    if not blobs:
        return []
    msg = _Packed()
    try:
        msg.ParseFromString(_SEP.join(blobs) + _SEP)
        v = np.array(msg.v, dtype=np.int64)  # the repeated field's buffer: no per-element Python
    except Exception:  # noqa: BLE001 - malformed somewhere: decode each on its own
        return [_slow(b) for b in blobs]
    if len(v) % 2:
        return [_slow(b) for b in blobs]
    first = v[0::2]
    values = v[1::2]
    seps = np.flatnonzero(first == 0)
    if len(seps) != len(blobs) or not ((first == 0) | (first == _INT_TAG)).all():
        # some array holds non-integers (or hostile bytes): decode the batch one array at a time
        return [_slow(b) for b in blobs]
    starts = np.concatenate(([0], seps[:-1] + 1))
    return [values[a:b] for a, b in zip(starts.tolist(), seps.tolist())]
