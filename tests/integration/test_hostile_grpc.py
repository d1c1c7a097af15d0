"""Nothing a gRPC sender does holds the OTLP/gRPC receiver: calls that send their headers and
never their message end at the read timeout without blocking anyone else's Export, and a sender
without the token never has its message buffered (the collector's peak memory stays put)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from support.collector_harness import Bodies, Collector

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def test_stalled_calls_block_no_one(make_collector):
    c = make_collector(read_timeout_s=1.5, otlp_http=None)
    ch = grpc.insecure_channel(f"127.0.0.1:{c.receivers[0].port}")
    never = threading.Event()

    def headers_only():
        never.wait(30)  # the message never comes
        yield b""

    stalled = ch.stream_unary(EXPORT)
    held = [stalled.future(headers_only(), timeout=30) for _ in range(16)]  # 4x the worker threads
    time.sleep(0.3)
    try:
        call = ch.unary_unary(EXPORT)
        bodies = Bodies(salt=3)
        for i in range(8):  # answered while the 16 are still open
            assert call(bodies.body(i), timeout=5) == b""
        codes = [f.exception(timeout=10).code() for f in held]  # ended by the receiver
        assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}
    finally:
        never.set()
        ch.close()


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) / 1024 for line in fh if line.startswith("VmHWM:"))


@pytest.mark.slow
def test_no_message_is_buffered_before_the_token_is_checked(tmp_path):
    """300 concurrent Export calls of 4 MiB each (1.2 GB) without the token: every one refused
    UNAUTHENTICATED, and the collector's peak RSS grows by less than 100 MiB."""
    c = Collector(tmp_path / "a.db", ("--auth-token", "s3cret", "--max-message-bytes", str(5 << 20))).start()
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{c.grpc_port}", options=[("grpc.max_send_message_length", 8 << 20)])
        call = ch.unary_unary(EXPORT)
        assert call(Bodies().body(1), metadata=(("authorization", "Bearer s3cret"),), timeout=10) == b""
        before = _peak_rss_mib(c.proc.pid)
        big = b"\x0a" + b"\xff" * (4 << 20)

        def one(_):
            try:
                call(big, timeout=60)
                return "OK"
            except grpc.RpcError as exc:
                return exc.code().name

        with futures.ThreadPoolExecutor(64) as pool:
            codes = list(pool.map(one, range(300)))
        grown = _peak_rss_mib(c.proc.pid) - before
        print(f"peak RSS grew {grown:.1f} MiB over 300 unauthenticated 4 MiB calls")
        ch.close()
        assert set(codes) == {"UNAUTHENTICATED"}, sorted(set(codes))
        assert grown < 100, f"peak RSS grew {grown:.0f} MiB"
    finally:
        c.terminate()
