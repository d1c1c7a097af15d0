"""Makes docs/report.png, the README's picture of ``otel-llm report``: the report of a store (by
default the one ``make demo`` leaves in out/demo/demo.db) opened in headless Chromium.

Run: ``.venv/bin/python docs/make_screenshot.py [--store out/demo/demo.db]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=os.path.join(ROOT, "out", "demo", "demo.db"))
    ap.add_argument("--output", default=os.path.join(ROOT, "docs", "report.png"))
    a = ap.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        sys.exit("make_screenshot: Chromium is needed (make chromium)")
    tmp = tempfile.mkdtemp(prefix="otel-llm-shot-")
    html = os.path.join(tmp, "report.html")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "otel_llm",
            "report",
            "--store",
            a.store,
            "-o",
            html,
            "--slowest",
            "12",
            "--sample",
            "12",
        ]
        + ["--slo", "ttft=0.2,tpot=0.02", "--title", "otel-llm report: make demo's run"],
        check=True,
        cwd=ROOT,
    )
    shot = os.path.join(tmp, "shot.png")
    subprocess.run(
        [browser, "--headless=new", "--no-sandbox", "--enable-unsafe-swiftshader", "--hide-scrollbars"]
        + ["--host-resolver-rules=MAP * ~NOTFOUND", "--virtual-time-budget=30000", "--window-size=1400,3400"]
        + [f"--screenshot={shot}", "file://" + html],
        check=True,
        capture_output=True,
    )
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    img = img.resize((img.width * 2 // 3, img.height * 2 // 3), Image.LANCZOS)
    img.quantize(colors=128).save(a.output, optimize=True)
    print(f"wrote {a.output} ({os.path.getsize(a.output) // 1024} KiB)")


if __name__ == "__main__":
    main()
