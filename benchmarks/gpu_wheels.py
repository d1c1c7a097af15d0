"""Fetch, as wheels into ``.whl/``, the pure-Python packages benchmarks/gpu_check.py needs on a GPU
machine that has torch and transformers but no network (the lent H200): the OpenTelemetry API, SDK,
exporters and protobuf at the versions of this checkout's venv. ``.whl/`` is git-ignored.

Run here: ``.venv/bin/python benchmarks/gpu_wheels.py``; there (the device tool's command, ``.whl``
carried)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_check.py --json $OUT/gpu.json
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys

PACKAGES = (
    "opentelemetry-api",
    "opentelemetry-sdk",
    "opentelemetry-semantic-conventions",
    "opentelemetry-semantic-conventions-ai",
    "opentelemetry-proto",
    "opentelemetry-exporter-otlp",
    "opentelemetry-exporter-otlp-common",
    "opentelemetry-exporter-otlp-proto-common",
    "opentelemetry-exporter-otlp-proto-http",
    "opentelemetry-exporter-otlp-proto-grpc",
    "opentelemetry-exporter-http-transport",
    "googleapis-common-protos",
    "protobuf",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def main() -> int:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    dest = os.path.join(root, ".whl")
    pins = [f"{p}=={md.version(p)}" for p in PACKAGES]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    cmd += ["--implementation", "cp", *(x for p in PLATFORMS for x in ("--platform", p)), "-d", dest, *pins]
    subprocess.run(cmd, check=True)
    print(f"{len(os.listdir(dest))} wheels in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
