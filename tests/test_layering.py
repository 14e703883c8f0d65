"""The package's dependency rules, read off the source (every import, also those inside functions):
dependencies point one way (policies <- engine <- service, rollout, reference <- evaluation; the leaf
packages tasks and deathtime below them) and no two modules import each other, directly or in a circle.
Command modules (`cli.py`, `*_cli.py`) assemble commands from every layer and sit above the rules."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# package -> kvtier packages it must not import
FORBIDDEN = {
    "tasks": "*",
    "policies": "*",
    "deathtime": {"engine", "reference", "models", "evaluation", "service", "rollout", "benchmarks", "observability"},
    "engine": {"reference", "models", "evaluation", "service", "rollout", "benchmarks"},
    "reference": {"evaluation", "service", "rollout", "benchmarks"},
    "models": {"evaluation", "service", "rollout", "benchmarks", "reference"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "kvtier").rglob("*.py"):
        parts = p.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for t in targets:
            while t not in mods and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in mods and t != name:
                found.add(t)
    return found


def _graph():
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def test_layers_point_one_way():
    bad = []
    for mod, deps in _graph().items():
        parts = mod.split(".")
        if len(parts) < 2 or parts[1] not in FORBIDDEN or parts[-1] == "cli" or parts[-1].endswith("_cli"):
            continue
        rule = FORBIDDEN[parts[1]]
        for d in deps:
            other = d.split(".")[1] if "." in d else ""
            if other != parts[1] and (rule == "*" or other in rule):
                bad.append(f"{mod} imports {d}")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circles():
    graph = _graph()
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):           # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
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
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_the_cli_imports_no_heavy_dependency_until_a_command_runs():
    """kvtier/cli.py's promise (`kvtier --help` is fast): assembling every command imports neither vLLM, Ray,
    verl nor FastAPI (`kvtier engine check`'s package once imported vLLM at registration)."""
    import subprocess
    import sys

    code = ("import sys, kvtier.cli\n"
            "print([m for m in ('vllm', 'ray', 'verl', 'fastapi') if m in sys.modules])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "[]", (r.stdout, r.stderr[-2000:])
