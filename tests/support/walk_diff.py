"""The two OTLP walks side by side: the C walk (``decode.walk_bytes``) and protobuf with
``walk_message``, which must agree on every payload (test_collector_fastpath's properties and the
fuzz run use these)."""

from __future__ import annotations

import struct

import pytest

from collector.receivers import decode
from collector.receivers.decode import DecodeError, parse_request, walk_message

needs_ext = pytest.mark.skipif(decode._otlp_walk is None, reason="C accelerator not built (no compiler)")


def same(a, b) -> bool:
    """Walk results equal, floats compared bit for bit (NaN and -0.0 included)."""
    norm = lambda v: ("f", struct.pack("<d", v)) if isinstance(v, float) else (type(v).__name__, v)
    return (a.total, a.rejected, a.first_error) == (b.total, b.rejected, b.first_error) and [
        tuple(map(norm, s)) for s in a.spans
    ] == [tuple(map(norm, s)) for s in b.spans]


def differential(body: bytes) -> tuple[bool, bool]:
    """(protobuf accepted, C deferred); fails if the two disagree."""
    fast = decode.walk_bytes(body)
    try:
        slow = walk_message(parse_request(body))
    except DecodeError:
        assert fast is None, "the C walk accepted a payload protobuf rejects"
        return False, True
    assert fast is None or same(fast, slow), "the C walk and protobuf disagree"
    return True, fast is None
