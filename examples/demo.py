"""The main demo (``make demo``).

Step 1: analyse a shipped sample of request timelines with ``otel-llm analyze``.
Later steps (traced vLLM generation, collector, client comparison) are added as they land.
"""
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(*args: str) -> None:
    print("$ otel-llm " + " ".join(args), flush=True)
    subprocess.run([sys.executable, "-m", "otel_llm", *args], check=True)
    print(flush=True)


def main() -> None:
    sample = os.path.relpath(os.path.join(HERE, "sample_timelines.jsonl"))
    run("analyze", sample, "--slo", "ttft=0.3,tpot=0.04,itl_max=0.2")


if __name__ == "__main__":
    main()
