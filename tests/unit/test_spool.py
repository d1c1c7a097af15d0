"""The durable mode (--spool): what the collector acknowledged survives SIGKILL, is replayed once,
and the spool is emptied as its traces are stored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

from conftest import ROOT
from support.otlp_helpers import Req, free_port, sample_request

from collector.storage.spool import Spool
from collector.storage.store import RequestStore


def _post(port: int, body: bytes) -> int:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/traces", data=body, headers={"Content-Type": "application/x-protobuf"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status


def _collector(store, port, *extra):
    proc = subprocess.Popen(
        [sys.executable, "-m", "otel_llm", "collector", "--otlp-grpc", "off", "--otlp-http", f"127.0.0.1:{port}"]
        + ["--prometheus", "off", "--store", str(store), *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert "otel-llm collector:" in proc.stdout.readline()
    return proc


def _count(store) -> int:
    s = RequestStore(str(store))
    try:
        return s.count()
    finally:
        s.close()


def test_sigkill_loses_nothing_acknowledged_with_a_spool(tmp_path):
    """50 requests acknowledged, then SIGKILL before any was derived (a long grace). Without the
    spool all 100 records are gone; with it, the next start replays them, and a clean stop
    leaves the spool empty."""
    results = {}
    for mode in ("plain", "spool"):
        store, spool, port = tmp_path / f"{mode}.db", tmp_path / f"{mode}-spool", free_port()
        extra = ["--spool", str(spool)] if mode == "spool" else []
        proc = _collector(store, port, "--trace-grace", "60", *extra)
        try:
            for i in range(50):
                assert _post(port, sample_request([Req(f"{mode}{i}")]).SerializeToString()) == 200
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            proc.kill()
        lost_at_kill = 100 - _count(store)
        port = free_port()
        proc = _collector(store, port, "--trace-grace", "0.1", *extra)
        try:
            time.sleep(1.5)
            proc.send_signal(signal.SIGTERM)
            _out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
        assert proc.returncode == 0, err
        results[mode] = (lost_at_kill, _count(store))
        if mode == "spool":
            assert "replayed 50 accepted requests" in err
            assert [f for f in os.listdir(spool) if f.endswith(".spool")] == []  # emptied at the clean stop
    assert results["plain"] == (100, 0)  # what a crash loses without it (docs/commands.md says so)
    assert results["spool"] == (100, 100)
    store = RequestStore(str(tmp_path / "spool.db"))
    assert {r.request_id for r in store.records()} == {f"spool{i}" for i in range(50)}
    store.close()


def test_the_spool_is_emptied_as_traces_are_stored(make_collector, tmp_path):
    c = make_collector(spool=str(tmp_path / "sp"), spool_segment_bytes=8192)
    for i in range(400):  # a segment is closed before the append that finds it full
        c.accept(sample_request([Req(f"q{i}")]).SerializeToString())
    # more than 10 segments written in all (some may be stored and deleted already on a busy machine)
    assert c.spool.segments + c.spool.segments_deleted > 10
    deadline = time.monotonic() + 20
    while c.spool.segments > 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert c.spool.segments <= 2 and c.spool.segments_deleted > 10
    assert c.self_levels()["spool_bytes"] < 2 * 8192 + 4096


def test_replay_skips_a_torn_record(tmp_path):
    """A crash mid-write leaves a partial record at the end of a segment: the records before it
    are replayed, the torn one is counted and skipped."""
    d = str(tmp_path / "torn")
    s = Spool(d)
    bodies = [sample_request([Req(f"t{i}")]).SerializeToString() for i in range(3)]
    with s.lock:
        for b in bodies:
            s.append(b)
    s.close()
    (seg,) = [os.path.join(d, f) for f in os.listdir(d)]
    with open(seg, "r+b") as fh:
        fh.truncate(os.path.getsize(seg) - 5)
    again = Spool(d)
    assert list(again.replay()) == bodies[:2] and again.torn_records == 1 and again.replayed_requests == 2
    again.close()


def test_spool_full_answers_503(make_collector, tmp_path):
    from collector.receivers.intake import Overloaded

    c = make_collector(spool=str(tmp_path / "full"), spool_max_bytes=1 << 16)
    c.pause()
    body = sample_request([Req("f")]).SerializeToString()
    n = 0
    try:
        while n < 10_000:
            c.accept(sample_request([Req(f"f{n}")]).SerializeToString())
            n += 1
    except Overloaded as exc:
        assert "spool" in str(exc)
    assert 0 < n < 10_000 and c.spool.bytes <= 1 << 16
    assert len(body) * n <= 1 << 16
