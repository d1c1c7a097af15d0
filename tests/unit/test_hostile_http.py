"""Nothing hostile goes unanswered on OTLP/HTTP: every malformed request gets a 4xx with a message,
held connections are timed out and capped, the token is checked before the body is read, and the
receiver keeps serving."""

import socket
import time

import pytest
from support.otlp_helpers import sample_request

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


def _self_signed(tmp_path):
    """A certificate and key for 127.0.0.1 (cryptography, a dependency of the installed SDKs)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


def _https_post(port: int, cafile: str, body: bytes) -> int:
    import ssl
    import urllib.request

    ctx = ssl.create_default_context(cafile=cafile)
    req = urllib.request.Request(
        f"https://127.0.0.1:{port}/v1/traces", data=body, headers={"Content-Type": "application/x-protobuf"}
    )
    with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
        return r.status


def test_a_silent_tls_client_blocks_nobody(make_collector, tmp_path):
    """With TLS on, a TCP connection that never sends its ClientHello (or sends garbage) holds one
    connection slot until the read timeout, not the accept loop: other clients are served at once,
    the stalled handshake is counted, and the collector stops promptly while it is still open."""
    cert, key = _self_signed(tmp_path)
    c = make_collector(tls_cert=cert, tls_key=key, read_timeout_s=1.0, otlp_grpc=None)
    port = c.receivers[0].address[1]
    body = sample_request().SerializeToString()
    silent = socket.create_connection(("127.0.0.1", port), timeout=10)
    garbage = socket.create_connection(("127.0.0.1", port), timeout=10)
    garbage.sendall(b"GET / HTTP/1.1\r\n\r\n")  # plain HTTP to the TLS port
    try:
        time.sleep(0.2)
        t0 = time.monotonic()
        assert _https_post(port, cert, body) == 200
        assert time.monotonic() - t0 < 0.9  # not behind the silent client's timeout
        assert silent.recv(10) == b""  # the silent one is closed after the read timeout
        deadline = time.monotonic() + 5
        while c.receiver_counters.tls_handshakes_failed < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.receiver_counters.tls_handshakes_failed == 2
        again = socket.create_connection(("127.0.0.1", port), timeout=10)  # held open across stop()
        t0 = time.monotonic()
        c.stop()
        assert time.monotonic() - t0 < 5
        again.close()
    finally:
        silent.close()
        garbage.close()


def test_metrics_are_served_over_tls_when_the_receivers_use_it(make_collector, tmp_path):
    """--metrics-auth sends the receivers' token to /metrics: with TLS on, /metrics is HTTPS too,
    and the Bearer scheme is case-insensitive (RFC 9110) there as on the receivers."""
    import ssl
    import urllib.error
    import urllib.request

    cert, key = _self_signed(tmp_path)
    c = make_collector(tls_cert=cert, tls_key=key, auth_token="s3cret", metrics_auth=True, otlp_grpc=None)
    url = f"https://127.0.0.1:{c.prometheus.address[1]}/metrics"
    ctx = ssl.create_default_context(cafile=cert)
    for scheme in ("Bearer", "bearer", "BEARER"):
        req = urllib.request.Request(url, headers={"Authorization": f"{scheme} s3cret"})
        with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
            assert r.status == 200 and b"otel_llm_collector_" in r.read()
    for wrong in ("Bearer s3cre", "Basic s3cret", "Bearers3cret", ""):
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(
                urllib.request.Request(url, headers={"Authorization": wrong}), context=ctx, timeout=5
            )
        assert err.value.code == 401
    with pytest.raises(OSError):  # no cleartext
        urllib.request.urlopen(url.replace("https", "http"), timeout=5)


def test_the_bearer_scheme_is_case_insensitive_on_both_receivers(make_collector):
    import grpc

    c = make_collector(auth_token="tok")
    http_port, grpc_port = c.receivers[1].address[1], c.receivers[0].port
    body = sample_request().SerializeToString()
    ctype = "application/x-protobuf"
    for auth, want in (("bearer tok", b"200"), ("BeArEr  tok", b"200"), ("bearer tok2", b"401"), ("tok", b"401")):
        out = raw(http_port, post_head(len(body), ctype, f"Authorization: {auth}\r\n"), body)
        assert out.split(b" ")[1] == want, (auth, out[:80])
    call = grpc.insecure_channel(f"127.0.0.1:{grpc_port}").unary_unary(
        "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
    )
    assert call(body, metadata=(("authorization", "bearer tok"),), timeout=5) == b""
    with pytest.raises(grpc.RpcError) as err:
        call(body, metadata=(("authorization", "bearer nope"),), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_burst_of_new_connections_is_answered_not_reset(make_collector):
    """64 connections at once, more than socketserver's default listen backlog of 5: each one gets
    an HTTP answer (200, or 503 over --max-connections), none a reset."""
    import threading

    c = make_collector(otlp_grpc=None, max_connections=16)
    port = c.receivers[0].address[1]
    body = sample_request().SerializeToString()
    answers: list = []
    go = threading.Event()

    def one():
        go.wait()
        try:
            answers.append(raw(port, post_head(len(body), "application/x-protobuf"), body).split(b" ")[1])
        except OSError as exc:
            answers.append(type(exc).__name__)

    threads = [threading.Thread(target=one) for _ in range(64)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(30)
    assert len(answers) == 64 and set(answers) <= {b"200", b"503"}, sorted(map(str, answers))[:5]


def test_slow_senders_cannot_hold_every_connection_slot(make_collector):
    """Every --max-connections slot taken by a sender trickling its headers a byte at a time,
    each byte inside --read-timeout: --request-timeout closes them, and a sender that retries on
    503 as the OTLP exporters do gets all its requests in."""
    import threading

    c = make_collector(otlp_grpc=None, max_connections=8, read_timeout_s=5.0, request_timeout_s=1.5)
    port = c.receivers[0].address[1]
    stop = threading.Event()

    def trickle():
        head = post_head(10**6, "application/x-protobuf")
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            for b in head:
                if stop.is_set():
                    return
                try:
                    s.sendall(bytes([b]))
                except OSError:  # closed by the receiver
                    return
                time.sleep(0.3)

    slow = [threading.Thread(target=trickle, daemon=True) for _ in range(8)]
    for t in slow:
        t.start()
    time.sleep(0.5)
    body = sample_request().SerializeToString()
    ok, deadline = 0, time.monotonic() + 20
    try:
        while ok < 5 and time.monotonic() < deadline:
            try:
                answer = raw(port, post_head(len(body), "application/x-protobuf"), body, timeout=5)
            except OSError:
                answer = b""
            if answer.startswith(b"HTTP/1.1 200"):
                ok += 1
            else:
                time.sleep(0.2)  # 503: retry, as an exporter does
        assert ok == 5
        # the slots were freed by the deadline (each closed trickler let a retried request in)
        assert c.receiver_counters.requests_timed_out >= 1
    finally:
        stop.set()
