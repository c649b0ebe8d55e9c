"""Imports point down: the serving core does not import the layers built on it."""

import ast
from pathlib import Path

import redknot

ROOT = Path(redknot.__file__).resolve().parent
CORE = ("engine", "reuse", "cache", "kernels", "models")
ABOVE = ("redknot.testbed", "redknot.bench", "redknot.serve", "redknot.tiny")


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    package = ["redknot", *path.relative_to(ROOT).with_suffix("").parts][:-1]  # a module's package, or the package itself
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(x for x in (base, node.module) if x)
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def test_core_imports_nothing_above_it():
    wrong = [(str(f.relative_to(ROOT)), m) for layer in CORE for f in sorted((ROOT / layer).rglob("*.py"))
             for m in sorted(imported_modules(f)) if m.startswith(ABOVE)]
    assert not wrong, wrong


def test_the_check_sees_relative_imports():
    assert "redknot.qa.answers" in imported_modules(ROOT / "testbed" / "evaluate.py")
    assert "redknot.visibility" in imported_modules(ROOT / "kernels" / "reference.py")


def test_bench_and_testbed_share_records_not_each_other():
    testbed_up = [str(f) for f in (ROOT / "testbed").rglob("*.py")
                  if any(m.startswith("redknot.bench") for m in imported_modules(f))]
    assert not testbed_up
    for f in ("quality.py", "datasets.py"):
        assert not any(m.startswith("redknot.testbed") for m in imported_modules(ROOT / "bench" / f))


def test_the_visibility_rule_is_written_out_in_one_module():
    """Outside the kernels' device code and their torch reference, modules call redknot/visibility.py."""
    rule = "j <= p and (j < S or p - j < W or j in sel)"
    where = sorted(str(f.relative_to(ROOT)) for f in ROOT.rglob("*.py") if rule in f.read_text())
    assert where == ["visibility.py"]


def _module_name(path: Path) -> str:
    parts = ["redknot", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_import_cycle_inside_the_package():
    """Imports anywhere in a module count, inside functions too: two modules that need each other are
    one idea split in two. A module's own parent packages are left out (Python loads them first)."""
    files = {_module_name(f): f for f in ROOT.rglob("*.py")}
    graph = {m: {i for i in imported_modules(f) if i in files and i != m and not m.startswith(i + ".")}
             for m, f in files.items()}
    # Tarjan's strongly connected components: any with more than one module is a cycle
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    assert not cycles, cycles


def test_the_engine_stays_small():
    """The step loop reads as schedule, run, postprocess: the Engine class and every function of the
    engine package stay short (what grows goes to the scheduler, documents, executor, outputs)."""
    long = []
    for f in sorted((ROOT / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{f.name}:{node.name}")
            if isinstance(node, ast.ClassDef) and node.name == "Engine":
                assert node.end_lineno - node.lineno < 300, node.end_lineno - node.lineno
    assert not long, long
