"""The C accelerators are built the way current CPython wants extension modules (#45): multi-phase
initialisation (PEP 489: importing one again from its spec makes a new module object, where a
single-phase module hands back its one cached object), and none of the C API deprecated since 3.12.
Read from setup.py, so a new accelerator is checked too."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def accelerators() -> list[tuple[str, list[str]]]:
    """(module name, its C sources) of every Extension in setup.py, globs expanded."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple) and len(node.elts) == 3 and isinstance(node.elts[0], ast.Constant):
            name, sources = node.elts[0].value, node.elts[1]
            if isinstance(sources, ast.List):
                files = [e.value for e in sources.elts]
            else:  # sorted(glob("..."))
                files = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(sources.args[0].args[0].value))
            out.append((name, files))
    return out


MODULES = accelerators()


def test_setup_py_lists_the_three_accelerators():
    assert [n for n, _ in MODULES] == [
        "collector.receivers._otlp_walk",
        "engine_hooks.hot_path._hotpath",
        "otel_llm.otlp._int_text",
    ]


@pytest.mark.parametrize("name", [n for n, _ in MODULES])
def test_each_accelerator_uses_multi_phase_initialisation(name):
    try:
        first = importlib.import_module(name)
    except ImportError:
        pytest.skip(f"{name} is not built here (no C compiler): the Python twins run")
    spec = importlib.util.find_spec(name)
    again = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(again)
    assert again is not first  # single-phase: the one cached module object again


@pytest.mark.parametrize("name, sources", MODULES)
def test_no_c_api_deprecated_since_3_12(name, sources):
    deprecated = r"\b(PyErr_Fetch|PyErr_Restore|PyErr_NormalizeException|T_OBJECT|T_OBJECT_EX|PyModule_Create)\b"
    for src in sources:
        hits = [m.group(0) for m in re.finditer(deprecated, (ROOT / src).read_text())]
        assert hits == [], (src, hits)
