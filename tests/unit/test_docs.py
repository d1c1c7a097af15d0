"""The repository explains itself: every file its code and docs name exists, and every relative
link in its markdown resolves."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATH = re.compile(
    r"(?<![\w/.])((?:otel_llm|engine_hooks|collector|tests|docs|benchmarks|examples|deploy)/[\w/.-]+\.(?:py|md|c|yml|yaml|json))"
)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _tracked(*patterns: str) -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", *patterns], cwd=ROOT, capture_output=True, text=True
    )
    return [f for f in out.stdout.split() if os.path.exists(os.path.join(ROOT, f))]


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        return fh.read()


def test_every_named_file_exists():
    missing = []
    for f in _tracked("*.py", "*.md", "*.c", "Makefile"):
        text = _read(f)
        for m in PATH.finditer(text):
            p = m.group(1)
            if not any(
                os.path.exists(os.path.join(base, p)) for base in (ROOT, os.path.join(ROOT, os.path.dirname(f)))
            ):
                missing.append(f"{f}: {p}")
    assert not missing, "named but absent:\n" + "\n".join(missing)


def test_markdown_links_resolve():
    broken = []
    for f in _tracked("*.md"):
        text = _read(f)
        for m in LINK.finditer(text):
            target = m.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.join(ROOT, os.path.dirname(f), target)):
                broken.append(f"{f}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_links_the_architecture():
    assert "(docs/architecture.md)" in _read("README.md")
