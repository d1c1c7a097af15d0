"""A disaggregated prefill/decode deployment on one machine, as the P/D demo
(``examples/pd_demo.py``) and the tests run one: a prefill and a decode vLLM server (CPU build)
whose KV caches move with NIXL over TCP, and the reference proxy (``examples/pd_proxy.py``) in
front of them. What it takes: NIXL installed beside vLLM (``make pd``), UCX over TCP, a side
channel port per server, one OpenMP thread each (two engines on few cores), and on a CPU with AMX
the cure in ``examples/pd_amx`` on the servers' ``PYTHONPATH``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from engine_hooks.tiny_model import free_port, start_cpu_server, stop_cpu_server, wait_until_up

ROOT = Path(__file__).resolve().parents[1]
AMX_SITE = ROOT / "examples" / "pd_amx"


def kv_config(role: str, connector: str = "NixlConnector", **extra) -> str:
    """``--kv-transfer-config`` for a ``kv_producer`` (prefill) or ``kv_consumer`` (decode)."""
    cfg = {"kv_connector": connector, "kv_role": role, "kv_buffer_device": "cpu", **extra}
    return json.dumps(cfg)


def server_env(env: dict) -> dict:
    """What a P/D server needs here, beside ``env``: NIXL over TCP on loopback, no core binding,
    one OpenMP thread (two engines on two cores), and the AMX cure first on PYTHONPATH."""
    path = os.pathsep.join(p for p in (str(AMX_SITE), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "UCX_TLS": "tcp",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": path,
        **env,
    }


@dataclass
class PD:
    prefill: subprocess.Popen
    decode: subprocess.Popen
    proxy: subprocess.Popen
    prefill_url: str  # .../v1
    decode_url: str
    proxy_url: str
    logs: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.proxy.poll() is None:
            self.proxy.terminate()
            try:
                self.proxy.wait(20)
            except subprocess.TimeoutExpired:
                self.proxy.kill()
                self.proxy.wait()
        for s in (self.decode, self.prefill):
            stop_cpu_server(s)


def start_proxy(prefill_url: str, decode_url: str, env: dict, log_path: str, trace: bool = True):
    """The reference proxy on a free port; returns (process, base URL ending in /v1)."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "examples" / "pd_proxy.py"), "--port", str(port)]
    cmd += ["--prefill", prefill_url.removesuffix("/v1"), "--decode", decode_url.removesuffix("/v1")]
    if not trace:
        cmd.append("--no-trace")
    log = open(log_path, "w")  # noqa: SIM115 (held by the proxy)
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
    why = wait_until_up(proc, f"http://127.0.0.1:{port}/health", 60, poll_s=0.2)
    if why is None:
        return proc, f"http://127.0.0.1:{port}/v1"
    proc.kill()
    raise RuntimeError(f"the P/D proxy {why}; see {log_path}")


def start_pd(
    model: str,
    env: dict,
    log_dir: str,
    connector: str = "NixlConnector",
    trace_proxy: bool = True,
    connector_config: dict | None = None,
) -> PD:
    """Start the prefill server, the decode server and the proxy (``env``: for all three, e.g.
    the OTLP endpoint and ``OTEL_LLM_ENABLE``); the caller stops them with :meth:`PD.stop`.
    ``connector_config``: the connector's ``kv_connector_extra_config`` (the disk connector,
    ``ExampleConnector``: ``{"shared_storage_path": DIR}``, one directory for both)."""
    import importlib.util

    if connector == "NixlConnector" and importlib.util.find_spec("nixl") is None:
        raise RuntimeError("NIXL is not installed in this venv: `make pd` installs it (make test does)")
    extra = {"kv_connector_extra_config": connector_config} if connector_config else {}
    started: list = []
    try:
        urls = []
        for role in ("kv_producer", "kv_consumer"):
            log = os.path.join(log_dir, f"pd-{role}-{{port}}.log")
            proc, url = start_cpu_server(
                model, server_env(env), log, extra_args=("--kv-transfer-config", kv_config(role, connector, **extra))
            )
            started.append(proc)
            urls.append(url)
        proxy, proxy_url = start_proxy(urls[0], urls[1], env, os.path.join(log_dir, "pd-proxy.log"), trace_proxy)
    except BaseException:
        for s in started:
            stop_cpu_server(s)
        raise
    return PD(started[0], started[1], proxy, urls[0], urls[1], proxy_url)
