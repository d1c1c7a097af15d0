"""The layout's contracts (docs/architecture.md): no import cycle among the project's modules, and
imports between the three packages point one way (engine_hooks -> otel_llm, collector ->
otel_llm; the core imports neither). Every import counts, also one inside a function: a lazy
import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("otel_llm", "engine_hooks", "collector")
ALLOWED = {"otel_llm": set(), "engine_hooks": {"otel_llm"}, "collector": {"otel_llm"}}


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, known: dict) -> set[str]:
    """The project modules ``name`` imports (its own ancestor packages left out: Python imports
    them first whatever the module says)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:  # a submodule if there is one of that name, else the module itself
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    return {m for m in found if m in known and m != name and m not in ancestors}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    known = modules()
    graph = {m: imports(m, p, known) for m, p in known.items()}
    assert cycles(graph) == []


def relative_imports_beyond_the_top(name: str, path: Path) -> list[str]:
    """Relative imports that climb above the module's top-level package (an ImportError when they
    run: inside a function, only then)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    depth = package.count(".") + 1
    return [
        f"{name}:{node.lineno}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level > depth
    ]


def test_every_relative_import_stays_inside_its_package():
    assert [bad for m, p in modules().items() for bad in relative_imports_beyond_the_top(m, p)] == []


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_between_packages_point_one_way():
    known = modules()
    wrong = sorted(
        f"{m} imports {t}"
        for m, p in known.items()
        for t in imports(m, p, known)
        if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in ALLOWED[m.split(".")[0]]
    )
    assert wrong == []


#: Each package's stages (docs/architecture.md): what each stage (a subpackage, or a module of the
#: package's top level) may import of its package besides itself. The leaves (configuration,
#: conventions) any stage may read, and they import no stage; the modules that assemble stages (the
#: collector's service and cli, the core's cli, the engine side's pipeline and api) none may import.
STAGES = {
    "collector": {
        "pipeline": set(),
        "storage": {"pipeline"},
        "receivers": {"pipeline"},
        "exporters": {"pipeline", "receivers"},
        "analysis": {"pipeline", "storage", "receivers"},
    },
    "engine_hooks": {
        "hot_path": set(),
        "spans": {"hot_path"},
        "span_process": {"hot_path", "spans"},
    },
    "otel_llm": {
        "metrics": set(),
        "otlp": set(),
        "client": {"metrics", "otlp"},
        "cli_options": {"metrics"},  # the options every subcommand shares, parsed into metrics' types
        "bench": {"metrics", "otlp", "client", "cli_options"},
    },
}
LEAVES = {
    "collector.config",
    "collector.tls",
    "collector.health",
    "otel_llm.semconv",
    "otel_llm.environment",
    "otel_llm.declared_options",
    "otel_llm.clock",
    "otel_llm.accelerator",
}


def stage_of(module: str) -> str | None:
    """The stage ``module`` belongs to (its package's subpackage or top-level module named in
    STAGES), or None."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES.get(parts[0], {}) else None


def arrows_against_the_stages(graph: dict[str, set[str]]) -> list[str]:
    """Every import, inside one package, that its stage's row of STAGES does not allow: a stage
    importing a later stage or a module that assembles stages; a leaf importing anything of its
    package but another leaf."""
    wrong = []
    for m, targets in graph.items():
        pkg, stage = m.split(".")[0], stage_of(m)
        if stage is None and m not in LEAVES:
            continue
        for t in targets:
            if t.split(".")[0] != pkg or t in LEAVES:
                continue
            target = stage_of(t)
            if m in LEAVES or target is None or (target != stage and target not in STAGES[pkg][stage]):
                wrong.append(f"{m} imports {t}")
    return sorted(wrong)


def test_stages_import_only_the_stages_before_them():
    known = modules()
    graph = {m: imports(m, p, known) for m, p in known.items()}
    for pkg, stages in STAGES.items():  # every stage named is there
        assert {m.split(".")[1] for m in known if m.startswith(pkg + ".")} >= set(stages)
    assert arrows_against_the_stages(graph) == []


def test_the_stage_checker_finds_a_wrong_arrow():
    graph = {
        "collector.pipeline.derive": {"collector.analysis.compare", "collector.config"},
        "collector.analysis.report": {"collector.pipeline.records", "collector.cli"},
        "collector.storage.store": {"collector.pipeline.records"},
        "otel_llm.metrics.summary": {"otel_llm.client.traced", "otel_llm.semconv"},
        "otel_llm.bench.load": {"otel_llm.client.traced", "otel_llm.cli"},
        "engine_hooks.hot_path.recorder": {"engine_hooks.spans.tracker"},
        "engine_hooks.span_process.parent": {"engine_hooks.hot_path.hook_events", "engine_hooks.pipeline"},
        "collector.config": {"collector.exporters.trace_policy", "collector.tls", "otel_llm.metrics.slo"},
        "otel_llm.cli_options": {"otel_llm.metrics.slo", "otel_llm.client.traced"},
    }
    assert arrows_against_the_stages(graph) == [
        "collector.analysis.report imports collector.cli",
        "collector.config imports collector.exporters.trace_policy",
        "collector.pipeline.derive imports collector.analysis.compare",
        "engine_hooks.hot_path.recorder imports engine_hooks.spans.tracker",
        "engine_hooks.span_process.parent imports engine_hooks.pipeline",
        "otel_llm.bench.load imports otel_llm.cli",
        "otel_llm.cli_options imports otel_llm.client.traced",
        "otel_llm.metrics.summary imports otel_llm.client.traced",
    ]


def test_the_relative_import_checker_finds_one_beyond_the_top(tmp_path):
    bad = tmp_path / "cli.py"
    bad.write_text("def register():\n    from ..cli import add_stall_options\n")
    assert relative_imports_beyond_the_top("collector.cli", bad) == ["collector.cli:2"]
    bad.write_text("def register():\n    from .analysis import report\n")
    assert relative_imports_beyond_the_top("collector.cli", bad) == []


def imports_into_tests(path: Path) -> list[str]:
    """What a file outside tests/ imports of tests/ (a ``support``, ``conftest`` or ``test_*``
    module), and every ``sys.path`` entry it builds that names the tests folder."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        out += [(node.lineno, f"imports {n}") for n in names if n.split(".")[0] in TESTS_MODULES]
        if isinstance(node, ast.Constant) and node.value == "tests":
            out.append((node.lineno, "names the tests folder"))
    return [f"{path.name}:{line} {what}" for line, what in sorted(out)]


#: The top-level names tests/ makes importable: its helper package, conftest, and the test modules.
TESTS_MODULES = {"support", "conftest"} | {p.stem for p in (ROOT / "tests").rglob("test_*.py")}


def test_benchmarks_import_the_package_never_the_tests():
    assert [bad for p in sorted((ROOT / "benchmarks").rglob("*.py")) for bad in imports_into_tests(p)] == []


def test_test_modules_import_conftest_and_support_not_each_other():
    """A test module's shared code lives in tests/support (or conftest's fixtures), never in
    another test module."""
    wrong = []
    for p in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("test_"):
                wrong.append(f"{p.relative_to(ROOT)}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Import):
                wrong += [
                    f"{p.relative_to(ROOT)}:{node.lineno} imports {a.name}"
                    for a in node.names
                    if a.name.startswith("test_")
                ]
    assert wrong == []


def test_the_tests_checker_finds_an_import_and_a_path(tmp_path):
    bad = tmp_path / "bench.py"
    bad.write_text(
        'import sys\nsys.path.insert(0, os.path.join(ROOT, "tests"))\nfrom support.otlp_helpers import Req\n'
    )
    assert imports_into_tests(bad) == ["bench.py:2 names the tests folder", "bench.py:3 imports support.otlp_helpers"]


#: the longest a function of the packages may be, in lines (its def to its last line, docstring in)
MAX_FUNCTION_LINES = 80


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function (nested ones too) of ``path`` longer than ``limit`` lines."""
    return [
        f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_of_the_packages_is_over_80_lines():
    """A function that does not fit on a screen does several things: one per function (the report
    draws one figure per function, derivation has one function per stage)."""
    assert [f"{m}: {bad}" for m, p in modules().items() for bad in long_functions(p)] == []


def test_the_length_checker_counts_a_function_from_def_to_last_line(tmp_path):
    f = tmp_path / "m.py"
    body = "    x = 1\n" * 78
    f.write_text(f"def fits():\n{body}    return x\n\n\nasync def over():\n{body}    x += 1\n    return x\n")
    assert long_functions(f) == ["m.py:83 over (81 lines)"]
