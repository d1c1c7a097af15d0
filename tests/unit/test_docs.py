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


def _options(parser, path=()):
    """(subcommand path, long option) of every option of ``parser`` and its subcommands."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*path, name))
        for opt in action.option_strings:
            if opt.startswith("--") and opt != "--help":
                yield " ".join(path), opt


def test_every_command_line_option_is_in_the_commands_page():
    """docs/commands.md names every option of every subcommand (the declarations are the parsers:
    the collector's fields, bench's and the others' add_argument): one added without its line here
    fails, so the page cannot drift from the code."""
    from otel_llm.cli import build_parser

    doc = _read("docs/commands.md")
    options = list(_options(build_parser()))
    assert len(options) > 90  # every subcommand's, collected
    missing = [f"{cmd} {opt}" for cmd, opt in options if not re.search(re.escape(opt) + r"(?![\w-])", doc)]
    assert missing == [], "options docs/commands.md does not name: " + ", ".join(missing)


def test_every_variable_the_code_reads_is_in_the_configuration_page():
    """docs/configuration.md names every environment variable otel_llm/environment.py declares
    (where each is parsed: the one place), so the page cannot drift from the code."""
    from otel_llm import environment

    doc = _read("docs/configuration.md")
    names = [
        v
        for k, v in vars(environment).items()
        if k.isupper() and type(v) is str and re.fullmatch(r"(OTEL|OPENAI)_[A-Z0-9_]+", v)
    ]
    assert len(names) > 25
    missing = [v for v in names if v.rstrip("_") not in doc]
    assert missing == [], "variables docs/configuration.md does not name: " + ", ".join(missing)
