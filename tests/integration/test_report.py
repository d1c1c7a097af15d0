"""``otel-llm report``: the HTML file opened in a real browser (Debian's Chromium, headless, no
network): no console errors, every figure drawn and not blank; the PNGs; the figures' data against
the store's."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from collector.pipeline.steps import StepBatch
from collector.storage.store import RequestStore

DEMO = ROOT / "tests" / "data" / "demo_store.db"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="`make test` installs Debian's chromium")


@pytest.fixture(scope="module")
def rich_store(tmp_path_factory) -> Path:
    """The demo's real store (42 requests at both boundaries), with engine steps across its time
    (every 5 ms, one slow step with a preemption) and its requests split into two bench runs."""
    path = tmp_path_factory.mktemp("report") / "store.db"
    shutil.copy(DEMO, path)
    s = RequestStore(str(path))
    b = s.batch("engine")
    t0, t1 = int(b.submit_ns.min()), int(b.end_ns.max())
    starts = np.arange(t0, t1, 5_000_000, dtype=np.int64)
    n = len(starts)
    dur = np.full(n, 4_000_000, np.int64)
    dur[n // 2] = 40_000_000
    pre = np.zeros(n, np.int64)
    pre[n // 2] = 1
    s.add(
        StepBatch(
            trace_id=["ab" * 16] * n,
            span_id=[f"{i:016x}" for i in range(n)],
            service=["vllm"] * n,
            start_ns=starts,
            end_ns=starts + dur,
            step_index=np.arange(n),
            batch_size=1 + np.arange(n) % 8,
            prefill_tokens=np.where(np.arange(n) % 10 == 0, 48, 0),
            decode_tokens=1 + np.arange(n) % 8,
            preempted=pre,
            kv_usage=np.linspace(0.1, 0.9, n),
            gpu_time_ns=np.full(n, -1),
        )
    )
    s._db.execute("UPDATE requests SET run_id = CASE WHEN submit_ns < ? THEN 'slow' ELSE 'fast' END", ((t0 + t1) // 2,))
    s.close()
    return path


def report(store: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "otel_llm", "report", "--store", str(store), "-o", str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Headless Chromium with the network unreachable (every host name fails to resolve)."""
    base = [CHROMIUM, "--headless=new", "--no-sandbox", "--enable-unsafe-swiftshader", "--hide-scrollbars"]
    base += ["--host-resolver-rules=MAP * ~NOTFOUND", "--enable-logging=stderr", "--v=0"]
    return subprocess.run([*base, *args], capture_output=True, text=True, timeout=timeout)


CONSOLE_ERROR = re.compile(r"Uncaught|Error|Failed to load|net::ERR_", re.IGNORECASE)


def console_errors(stderr: str) -> list[str]:
    """The page's console messages that are errors (the software-WebGL notices are not)."""
    lines = [ln for ln in stderr.splitlines() if ":CONSOLE" in ln]
    return [ln for ln in lines if CONSOLE_ERROR.search(ln) and "GL Driver Message" not in ln]


def blank(png: Path) -> bool:
    from PIL import Image

    img = np.asarray(Image.open(png).convert("RGB"), dtype=np.int32)
    colors = len(np.unique(img.reshape(-1, 3), axis=0))
    return img.std() < 5 or colors < 16


@needs_chromium
@pytest.mark.slow
@pytest.mark.parallel_safe  # Chromium on virtual time: nothing here depends on the machine's speed
def test_the_report_opens_offline_in_a_browser(rich_store, tmp_path):
    out = tmp_path / "report.html"
    p = report(rich_store, out, "--png", str(tmp_path / "png"), "--slo", "ttft=0.2,tpot=0.02")
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    # self-contained: no script, stylesheet or image fetched from anywhere
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=", text)
    meta = json.loads(re.search(r"<script type='application/json' id='report-meta'>(.*?)</script>", text).group(1))
    figures = meta["figures"]
    expected = {
        "fig-share",
        "fig-decomposition",
        "fig-waterfall",
        "fig-steps",
        "fig-itl",
        "fig-over-time",
        "fig-stalls",
        "fig-sweep",
    }
    assert set(figures) == expected
    dom = chromium("--virtual-time-budget=30000", "--dump-dom", out.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert console_errors(dom.stderr) == []
    drawn = {}
    for fid in figures:  # Plotly drew each: its div became a plot with an SVG and at least one trace
        m = re.search(
            rf'<div id="{fid}" class="plotly-graph-div js-plotly-plot".*?(?=<div class=.figure|</body>)',
            dom.stdout,
            re.S,
        )
        assert m, fid
        assert 'class="main-svg"' in m.group(0) and re.search(
            r'class="(trace|gl-container|scatterlayer)', m.group(0)
        ), fid
        drawn[fid] = m.group(0)
    # the layout as Chromium drew it (#46 item 11): every part of the share bar named in the legend
    # with its share; the log axes' labels few and none twice
    legend = re.findall(r'class="legendtext"[^>]*>([^<]+)<', drawn["fig-share"])
    assert legend and all(re.fullmatch(r"\w+ \d+\.\d%", t) for t in legend), legend
    for fid, tick in (("fig-itl", "xtick"), ("fig-over-time", "ytick")):
        labels = re.findall(rf'<g class="{tick}"><text[^>]*>([^<]+)<', drawn[fid])
        assert 2 <= len(labels) <= 8 and len(set(labels)) == len(labels), (fid, labels)
    shot = tmp_path / "shot.png"
    s = chromium("--virtual-time-budget=30000", "--window-size=1400,5000", f"--screenshot={shot}", out.as_uri())
    assert s.returncode == 0 and shot.exists() and not blank(shot)
    pngs = sorted((tmp_path / "png").glob("*.png"))
    assert {p.stem for p in pngs} == expected and not any(blank(p) for p in pngs)


def test_the_figures_hold_the_stores_numbers(rich_store):
    """What the report draws is the store's data: the decomposition's parts sum to the client TTFT,
    the waterfall's tokens are the records' events, the steps are the stored steps, the sweep has one
    point per run."""
    from collector.analysis.report_data import build_report
    from collector.storage.store import open_existing

    s = open_existing(str(rich_store))
    batch, steps = s.batch(), s.steps()
    s.close()
    d = build_report(batch, steps, source="t", slowest=5, sample=10)
    client = {r.request_id: r for r in batch.records() if r.boundary == "client"}
    label, parts = d.decomposition[0]
    assert label.startswith("p50 (")
    rid = label[5:-1]
    assert sum(parts.values()) == pytest.approx(client[rid].ttft, abs=1e-9)
    slowest = sorted(client.values(), key=lambda r: -r.ttft)[:5]
    assert [lab for lab, _ in d.decomposition[3:]] == [r.request_id for r in slowest]
    w = d.waterfall[0]
    top = max(client.values(), key=lambda r: r.e2e)
    assert w.id == top.request_id and w.group == "slowest" and len(d.waterfall) == 15
    assert w.client_tokens == pytest.approx([(top.submit_ns + o - d.origin_ns) / 1e9 for o in top.event_offsets_ns])
    assert w.client_end - w.client_submit == pytest.approx(top.e2e)
    assert d.steps.total == len(steps) and d.steps.duration.max() == pytest.approx(0.040)
    assert [p.run_id for p in d.sweep] and {p.run_id for p in d.sweep} == {"slow", "fast"}
    assert sum(p.requests for p in d.sweep) == len(client)
    assert d.summaries["client"].counts.requests == len(client)

    # the overall share is compare's: each part's share of the summed TTFT, summing to 1
    from collector.analysis.compare import compare, summarize_comparison

    share = summarize_comparison(compare(batch.records())).ttft_share
    assert d.ttft_share == pytest.approx(share) and sum(v for v in d.ttft_share.values() if v) == pytest.approx(1)
    from collector.analysis.report import figures
    from collector.pipeline.stalls import ALL_CLASSES, STALL_CLASSES

    figs = figures(d)
    bars = {t.name.split(" ")[0]: t.x[0] for t in figs["fig-share"].data}
    assert bars == pytest.approx({k: v * 100 for k, v in share.items() if v is not None})
    # every part is named with its share in the legend, small ones too; a label inside a bar is level
    assert all(t.name == f"{t.name.split(' ')[0]} {t.x[0]:.1f}%" for t in figs["fig-share"].data)
    assert all(t.textangle == 0 for t in figs["fig-share"].data if t.text)
    # log axes (#46 item 11): over the data, never a decade below it, a few labels, none twice
    itl_x = np.concatenate([x for x, _ in d.itl_cdf.values()]) * 1e3
    for axis, data in ((figs["fig-itl"].layout.xaxis, itl_x), (figs["fig-over-time"].layout.yaxis, None)):
        lo, hi = axis.range
        if data is not None:
            assert np.log10(data.min()) - 0.2 < lo <= np.log10(data.min()) and hi >= np.log10(data.max())
        assert 2 <= len(axis.tickvals) <= 8 and len(set(axis.ticktext)) == len(axis.ticktext)
        assert all(lo <= np.log10(t) <= hi for t in axis.tickvals)
    # the stall chart: the causes compare counts (and those steps refined), one colour each
    stalls = figs["fig-stalls"].data[0]
    assert set(STALL_CLASSES) <= set(stalls.x) <= set(ALL_CLASSES) | {"unknown"}
    assert len(set(stalls.marker.color)) == len(stalls.x)
    # the waterfall: ms after each request's own start, so every row starts at 0
    wf = figs["fig-waterfall"]
    client_bar = next(t for t in wf.data if t.name.startswith("client"))
    assert list(client_bar.base) == [0.0] * len(client_bar.base)
    assert client_bar.x[0] == pytest.approx(top.e2e * 1e3)
    # legends read in the bars' order; the steps' counts hold until the next step
    assert figs["fig-decomposition"].layout.legend.traceorder == "normal"
    assert {t.name: t.line.shape for t in figs["fig-steps"].data if t.mode == "lines"} == {
        "batch size": "hv",
        "prefill tokens": "hv",
        "decode tokens": "hv",
        "KV usage": "hv",
    }


def test_report_errors_are_usage_errors(tmp_path):
    p = report(tmp_path / "nope.db", tmp_path / "r.html")
    assert p.returncode == 2 and "no such store" in p.stderr
    p = subprocess.run([sys.executable, "-m", "otel_llm", "report"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 2 and "--store" in p.stderr
    p = report(DEMO, tmp_path / "r.html", "--run", "no-such-run")
    assert p.returncode == 2 and "records match the selection" in p.stderr
    # a store with no records: said as such, not as a selection that matched nothing (#46 item 12)
    empty = tmp_path / "empty.db"
    from collector.storage.store import RequestStore

    RequestStore(str(empty)).close()
    p = report(empty, tmp_path / "r.html")
    assert p.returncode == 2 and "no records yet" in p.stderr and "selection" not in p.stderr
    # an output directory that is not there: one line, before any work, for every command that writes one
    missing = tmp_path / "no-such-dir"
    for args in (
        ["report", "--store", DEMO, "-o", missing / "r.html"],
        ["export", "--format", "perfetto", "--store", DEMO, "-o", missing / "t.json"],
        ["bench", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--rate", "1", "--output", missing / "t"],
    ):
        cmd = [sys.executable, "-m", "otel_llm", *map(str, args)]
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 2 and f"the directory {missing} does not exist" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr


def test_perfetto_export_has_a_track_per_request_and_the_steps(rich_store, tmp_path):
    """The Chrome trace event file, read back with a JSON reader: one named track per request with
    its client span and engine phases at the stores' times, every token event as an instant, one
    track of the engine's steps with a slice per stored step at its time."""
    from collector.storage.store import open_existing

    out = tmp_path / "run.json"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "otel_llm",
            "export",
            "--format",
            "perfetto",
            "--store",
            str(rich_store),
            "-o",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    ev = doc["traceEvents"]
    s = open_existing(str(rich_store))
    batch, steps = s.batch(), s.steps()
    s.close()
    client = {r.request_id: r for r in batch.records() if r.boundary == "client"}
    origin = doc["otherData"]["origin_unix_ns"]
    assert origin == min(r.submit_ns for r in client.values())
    names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 1}
    assert sorted(names.values()) == sorted(client)  # every request paired: one track each
    by_tid: dict[int, list[dict]] = {}
    for e in ev:
        if e["pid"] == 1 and e["ph"] in ("X", "i"):
            by_tid.setdefault(e["tid"], []).append(e)
    for tid, rid in names.items():
        r = client[rid]
        (span,) = [e for e in by_tid[tid] if e["name"] == "client request"]
        assert span["ts"] == pytest.approx((r.submit_ns - origin) / 1e3, abs=1e-3)
        assert span["dur"] == pytest.approx(r.e2e * 1e6, abs=1e-3)
        ticks = [e["ts"] for e in by_tid[tid] if e["name"] == "token (client)"]
        assert ticks == pytest.approx([(r.submit_ns + o - origin) / 1e3 for o in r.event_offsets_ns], abs=1e-3)
        phases = {e["name"] for e in by_tid[tid] if e["ph"] == "X"}
        assert {"queue", "prefill", "decode"} <= phases
        assert sum(e["name"] == "token (engine)" for e in by_tid[tid]) > 0
    step_slices = [e for e in ev if e["pid"] == 2 and e["ph"] == "X"]
    assert len(step_slices) == len(steps)
    theta = doc["otherData"]["clock_offset_s"]
    assert step_slices[0]["ts"] == pytest.approx((steps.start_ns[0] - theta * 1e9 - origin) / 1e3, abs=1)
    assert max(e["dur"] for e in step_slices) == pytest.approx(40_000, abs=1e-3)
    assert any(e["args"]["preempted"] for e in step_slices)
    assert {e["name"] for e in ev if e["pid"] == 2 and e["ph"] == "C"} == {"engine"}


def test_each_request_is_one_row_with_its_server_part(make_collector):
    """Records at three boundaries (client, HTTP server, engine): the report's waterfall has one row
    per request, never the server record as a request of its own, and Perfetto draws the server."""
    import time as _time

    from support.otlp_helpers import Req, sample_request

    from collector.analysis.perfetto import trace_events
    from collector.analysis.report_data import build_report

    c = make_collector()
    reqs = [Req(f"r{i}", server_received=5, server_chunks=[90, 120, 160]) for i in range(6)] + [Req("plain")]
    c.accept(sample_request(reqs).SerializeToString())
    deadline = _time.monotonic() + 10
    while c.records_derived < 6 * 3 + 2 and _time.monotonic() < deadline:
        _time.sleep(0.05)
    c.store_writer.drain()
    batch = c.store.batch()
    data = build_report(batch, None, source="test", slowest=3, sample=10)
    ids = [row.id for row in data.waterfall]
    assert sorted(ids) == sorted(r.id for r in reqs)  # one row each, none twice
    rows = {row.id: row for row in data.waterfall}
    assert rows["r0"].server_received is not None and len(rows["r0"].server_tokens) == 3
    assert rows["r0"].server_received <= rows["r0"].engine_arrival
    assert rows["plain"].server_received is None
    events = trace_events(batch, None)["traceEvents"]
    servers = [e for e in events if e.get("name") == "HTTP server"]
    threads = [e for e in events if e.get("name") == "thread_name"]
    assert len(servers) == 6 and len(threads) == 7
    # no engine steps (the default detail level): no empty "engine steps" process (#46 item 12)
    assert [e["args"]["name"] for e in events if e.get("name") == "process_name"] == ["requests"]


def test_a_report_without_engine_steps_says_why_they_are_missing(rich_store):
    """At the default detail level engines send no llm.engine.step spans: the report says so, and
    how to get them, where the step panels would be, instead of dropping them without a word."""
    from collector.analysis.report import NO_STEPS, figures, render_html
    from collector.analysis.report_data import build_report
    from collector.storage.store import open_existing

    s = open_existing(str(rich_store))
    batch, steps = s.batch(), s.steps()
    s.close()
    with_steps = build_report(batch, steps, source="t", slowest=3, sample=5)
    doc = render_html(with_steps, figures(with_steps))
    assert "data-note='no-steps'" not in doc and "fig-steps" in doc
    without = build_report(batch, None, source="t", slowest=3, sample=5)
    figs = figures(without)
    assert "fig-steps" not in figs
    doc = render_html(without, figs)
    assert "data-note='no-steps'" in doc and "OTEL_LLM_DETAIL=steps" in NO_STEPS


def test_the_steps_drawn_are_those_of_the_requests_drawn(rich_store):
    """Warm-up requests (or any left out by the selection) are not drawn, so neither are the engine
    steps before them: the steps' axis starts at the first request, not seconds before (#46 item 11)."""
    from collector.analysis.report_data import build_report
    from collector.storage.store import open_existing

    s = open_existing(str(rich_store))
    batch, steps = s.batch(), s.steps()
    s.close()
    late = np.flatnonzero(batch.submit_ns >= np.median(batch.submit_ns))
    d = build_report(batch.take(late), steps, source="t", slowest=3, sample=5)
    assert 0 < d.steps.total < len(steps)
    assert d.steps.start.min() >= -0.040  # at most the one step in progress when the first arrived
