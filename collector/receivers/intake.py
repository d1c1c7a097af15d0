"""The contract between a receiver and the rest of the collector: what a receiver may call, and
what it may be told. A receiver gets an :class:`Intake` (its next consumer, as a groupbytrace
processor gets only its next consumer), its :class:`~collector.config.ReceiverSettings` and the
:class:`ReceiverCounters` it adds to; never the whole service."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Protocol

from .decode import DecodeError, PayloadTooLarge


def token_matches(authorization: str | None, token: str) -> bool:
    """``Authorization: Bearer TOKEN``: the scheme case-insensitive (RFC 9110, 11.1), the token
    compared in constant time (no timing oracle on it)."""
    scheme, _, given = (authorization or "").strip().partition(" ")
    given = given.lstrip(" ")
    ok = hmac.compare_digest(given.encode("utf-8", "surrogateescape"), token.encode("utf-8", "surrogateescape"))
    return ok and scheme.lower() == "bearer"


class Overloaded(Exception):
    """The collector cannot take more now (derivation is behind): receivers answer UNAVAILABLE /
    503 with a retry delay."""

    retry_after_s = 1


@dataclass
class AcceptResult:
    rejected: int  # spans of the request refused (partial success)
    message: str | None  # why, for the partial-success message


@dataclass
class ReceiverCounters:
    requests: int = 0
    spans: int = 0
    spans_rejected: int = 0
    payloads_invalid: int = 0
    payloads_refused_overload: int = 0
    unauthenticated: int = 0
    connections_refused: int = 0  # OTLP/HTTP connections over --max-connections (answered 503)
    requests_timed_out: int = 0  # OTLP/HTTP requests not arrived whole within --request-timeout (closed)
    tls_handshakes_failed: int = 0  # failed or timed out (OTLP/HTTP)


class Intake(Protocol):
    def accept(self, body: bytes, *, json_body: bool = False, gzipped: bool = False) -> AcceptResult:
        """Take one OTLP export request (protobuf, or OTLP/JSON; gzip-compressed or not). Raises
        :class:`DecodeError` (malformed), :class:`PayloadTooLarge` (decompressed over the limit)
        or :class:`Overloaded`."""
        ...

    def accept_metrics(self, body: bytes, *, json_body: bool = False, gzipped: bool = False) -> bytes:
        """Take one OTLP metrics export request; returns the serialized response. Raises
        :class:`DecodeError` or :class:`PayloadTooLarge`."""
        ...


__all__ = [
    "AcceptResult",
    "DecodeError",
    "Intake",
    "Overloaded",
    "PayloadTooLarge",
    "ReceiverCounters",
    "token_matches",
]
