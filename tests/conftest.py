import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the tests read the engines' step spans (batch sizes, stalls' engine detail): trace every detail
# level unless told otherwise; tests/unit/test_detail_levels.py checks each level and the default
os.environ.setdefault("OTEL_LLM_DETAIL", "steps")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # tests side by side (make test's first part): vLLM's CPU worker binds its OpenMP threads to
    # core 0 by default, so two engines started at once share one core while the other idles. Those
    # tests measure no time; the serial part keeps vLLM's default binding, as users run it.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("OMP_NUM_THREADS", "1")


_KEPT = ("OTEL_", "VLLM_")  # what changes how a later engine or server traces and logs


def _settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_KEPT)}


@pytest.fixture(autouse=True)
def _settings_kept():
    """A test leaves the OTEL_* and VLLM_* settings of the process as it found them (monkeypatch
    restores its own): the engines and servers later tests start inherit them. A benchmark module
    imported for its stand-ins once set VLLM_LOGGING_LEVEL=WARNING here, and a later vLLM server's
    INFO line went missing. (Importing torch or vLLM sets a few variables of their own, once.)"""
    before = _settings()
    yield
    after = _settings()
    if after != before:
        for k in after.keys() - before.keys():
            del os.environ[k]
        os.environ.update(before)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        pytest.fail(f"the test changed the process's environment: {changed}", pytrace=False)


def c_or_python(monkeypatch, pure: bool, module) -> None:
    """One of a test's two runs: ``pure``, the Python twins (``OTEL_LLM_PURE_PYTHON=1``); else the C
    accelerator ``module``, skipped where it is not built or the whole run is pure Python
    (``make test-pure``)."""
    from otel_llm import accelerator

    if pure:
        monkeypatch.setenv("OTEL_LLM_PURE_PYTHON", "1")
    elif not accelerator.on(module):
        pytest.skip("the C accelerator is not built here, or this run is pure Python")


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_cli(*args, check=True, input=None, env=None):
    """Run the installed ``otel-llm`` command in a subprocess, as a user would."""
    full_env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "otel_llm", *map(str, args)],
        capture_output=True,
        text=True,
        input=input,
        cwd=ROOT,
        timeout=300,
        env=full_env,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"otel-llm {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def analyze_json(path, *args):
    return json.loads(run_cli("analyze", path, "--format", "json", *args).stdout)


@pytest.fixture
def jsonl(tmp_path):
    def make(rows, name="timelines.jsonl"):
        return write_jsonl(tmp_path / name, rows)

    return make


@pytest.fixture
def server():
    """A fake OpenAI-compatible server on loopback that speaks the wire format (tests/support/fake_openai.py)."""
    from support.fake_openai import FakeOpenAI

    s = FakeOpenAI()
    yield s
    s.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny random-weight Llama, built locally once per session (nothing downloaded)."""
    from engine_hooks.tiny_model import build_tiny_model

    cache = os.environ.get("OTEL_LLM_TINY_MODEL") or str(tmp_path_factory.mktemp("model") / "tiny-llama")
    return build_tiny_model(cache)


def run_vllm_scenario(tmp_path, scenario, model, timeout=400, env=None):
    """Run one scenario of tests/support/vllm_scenarios.py in its own process; returns (truth, spans)."""
    from otel_llm.otlp.span_records import read_trace_file

    traces = tmp_path / f"{scenario}.jsonl"
    out = tmp_path / f"{scenario}.json"
    full_env = {**os.environ, "OTEL_LLM_TRACES_FILE": str(traces), **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "vllm_scenarios.py"), scenario, model, str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text()), read_trace_file(traces)


@pytest.fixture
def make_collector(tmp_path):
    """Start in-process collectors on free loopback ports; stopped at the end of the test."""
    from collector.config import CollectorConfig
    from collector.pipeline.assembly import AssemblyConfig
    from collector.service import Collector

    started = []

    def make(**kw):
        assembly = kw.pop("assembly", AssemblyConfig(grace_s=0.2, timeout_s=5))
        cfg = CollectorConfig(
            otlp_grpc="127.0.0.1:0",
            otlp_http="127.0.0.1:0",
            prometheus="127.0.0.1:0",
            store=str(tmp_path / f"store{len(started)}.db"),
            assembly=assembly,
            tick_s=0.05,
        )
        for k, v in kw.items():
            setattr(cfg, k, v)
        c = Collector(cfg).start()
        started.append(c)
        return c

    yield make
    for c in started:
        try:
            c.stop()
        except Exception:
            pass


def start_collector(store: str, grace_s: float = 0.3):
    """An in-process collector on free loopback ports writing ``store``, and the environment that
    sends a process's spans to it over OTLP/HTTP (the caller stops it)."""
    from collector.config import CollectorConfig
    from collector.pipeline.assembly import AssemblyConfig
    from collector.service import Collector

    cfg = CollectorConfig(
        otlp_grpc="127.0.0.1:0",
        otlp_http="127.0.0.1:0",
        prometheus="127.0.0.1:0",
        store=store,
        assembly=AssemblyConfig(grace_s=grace_s, timeout_s=30),
        tick_s=0.05,
    )
    c = Collector(cfg).start()
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",  # run_cli turns exporting off unless told
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{c.receivers[1].address[1]}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    return c, env


def traced_server_env(c, **extra: str) -> dict:
    """The environment of a vLLM server traced by otel-llm's hooks that sends its spans to the
    in-process collector ``c`` over OTLP/HTTP."""
    return {
        "OTEL_LLM_ENABLE": "1",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{c.receivers[1].address[1]}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_TRACES_EXPORTER": "otlp",
        **extra,
    }


def start_vllm_server(model: str, env: dict, kv_bytes: int = 64 * 2**20, timeout: float = 180.0, extra_args=()):
    """Start vLLM's OpenAI-compatible server on a free loopback port (the CPU build); returns
    (process, base_url). The caller stops it. Its log: ``vllm-server-<port>.log`` beside the model."""
    from engine_hooks.tiny_model import start_cpu_server

    log = os.path.join(os.path.dirname(model), "vllm-server-{port}.log")
    try:
        return start_cpu_server(model, env, log, kv_bytes, timeout, extra_args)
    except RuntimeError as exc:
        raise AssertionError(str(exc)) from None


@pytest.fixture
def prometheus_jobs(tmp_path):
    """A real Prometheus (Debian's) scraping ``{job: [ports on 127.0.0.1]}`` every second; returns
    its port. Stopped after the test."""
    import shutil
    import time
    import urllib.request

    from support.otlp_helpers import free_port

    prometheus = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not os.path.exists(prometheus):
        pytest.fail("Debian's prometheus is not installed: run `make test`, which installs it")
    procs = []

    def start(jobs: dict[str, list[int]]) -> int:
        port = free_port()
        cfg = "global:\n  scrape_interval: 1s\nscrape_configs:\n"
        for job, ports in jobs.items():
            targets = ", ".join(repr(f"127.0.0.1:{p}") for p in ports)
            cfg += f"  - job_name: {job}\n    static_configs:\n      - targets: [{targets}]\n"
        (tmp_path / "prom.yml").write_text(cfg)
        proc = subprocess.Popen(
            [prometheus, f"--config.file={tmp_path / 'prom.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}"]
            + [f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(proc)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1)
                return port
            except OSError:
                time.sleep(0.2)
        raise AssertionError("prometheus did not become ready")

    yield start
    for p in procs:
        p.terminate()
        p.wait(10)


def pytest_collection_modifyitems(config, items):
    """The slow tests that may share the machine (parallel_safe) first, in collection order (the
    instruction count, the longest, leads), so that on make test's two workers they start while the
    quick tests fill the other."""
    items.sort(key=lambda item: item.get_closest_marker("parallel_safe") is None)


def promql(port, q, at=None):
    params = {"query": q, **({"time": repr(at)} if at is not None else {})}
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as r:
        d = json.load(r)
    assert d["status"] == "success", d
    return d["data"]["result"]


@pytest.fixture
def prometheus(prometheus_jobs):
    """A real Prometheus scraping one collector's /metrics port every second."""
    return lambda target_port: prometheus_jobs({"otel-llm-collector": [target_port]})
