"""Nothing hostile goes unanswered on OTLP/HTTP: every malformed request gets a 4xx with a message,
held connections are timed out and capped, the token is checked before the body is read, and the
receiver keeps serving."""

import socket
import time

import pytest
from otlp_helpers import sample_request

JSON = "application/json"


def raw(port: int, head: bytes, body: bytes = b"", timeout: float = 10.0) -> bytes:
    """Send bytes as they are (no client library to tidy them) and read the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + body)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out:
                length = [line for line in out.split(b"\r\n") if line.lower().startswith(b"content-length:")]
                if length and len(out.split(b"\r\n\r\n", 1)[1]) >= int(length[0].split(b":")[1]):
                    break
        return out


def post_head(n: int, ctype: str = JSON, extra: str = "") -> bytes:
    return (
        f"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: {n}\r\n{extra}\r\n".encode()
    )


def still_serving(port: int) -> bool:
    body = sample_request().SerializeToString()
    return raw(port, post_head(len(body), "application/x-protobuf"), body).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(
    "body, what",
    [
        (b'{"\\udc80":1}', "a lone surrogate"),
        (b"[" * 100_000, "nested 100,000 deep"),
        (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": 5}]}]}]}', "a number for an id"),
        (b"\xff\xfe{", "not UTF-8"),
    ],
    ids=["surrogate", "deep", "bad-id", "not-utf8"],
)
def test_malformed_json_gets_a_400_with_a_message(make_collector, body, what):
    c = make_collector()
    port = c.receivers[1].address[1]
    out = raw(port, post_head(len(body)), body)
    assert out.startswith(b"HTTP/1.1 400"), (what, out[:200])
    assert b'"message"' in out
    assert still_serving(port)


def test_a_content_length_that_is_not_ascii_digits(make_collector):
    c = make_collector()
    port = c.receivers[1].address[1]
    out = raw(port, "POST /v1/traces HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: ²\r\n\r\n".encode())
    assert out.startswith(b"HTTP/1.1 411") and still_serving(port)


def test_a_held_body_is_timed_out(make_collector):
    c = make_collector(read_timeout_s=0.5)
    port = c.receivers[1].address[1]
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(post_head(1000, "application/x-protobuf") + b"x" * 10)  # and then nothing
        assert s.recv(100) == b""  # the receiver closes the connection
    assert time.monotonic() - t0 < 5 and still_serving(port)


def test_the_token_is_checked_before_the_body_is_read(make_collector):
    c = make_collector(auth_token="s3cret", read_timeout_s=5)
    port = c.receivers[1].address[1]
    t0 = time.monotonic()
    out = raw(port, post_head(4_000_000, "application/x-protobuf", "Authorization: Bearer nope\r\n"))  # no body sent
    assert out.startswith(b"HTTP/1.1 401") and time.monotonic() - t0 < 2  # answered without waiting for it
    assert c.receiver_counters.unauthenticated == 1


def test_connections_are_capped(make_collector):
    c = make_collector(max_connections=2, read_timeout_s=5)
    port = c.receivers[1].address[1]
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
    try:
        for s in held:
            s.sendall(post_head(1000, "application/x-protobuf"))  # holding their bodies back
        time.sleep(0.3)
        out = raw(port, post_head(2))
        assert out.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in out
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert still_serving(port)  # the slots come back when the held connections go
