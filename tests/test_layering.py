"""The import structure docs/design.md section 2 describes, checked from the source: no import
circle, no module importing another module's `_private` names, the rooms' one-way rules, and the
commands that need no kernels running without numba imported."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "colibri"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every colibri import in the file,
    at module level or inside a function (a lazy import is still an arrow); not those under
    `if TYPE_CHECKING:`, which never run."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "colibri"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] != "colibri":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.append((sub, None, node.lineno) if sub in MODULES else (base, a.name, node.lineno))
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _owner(target: str) -> str:
    """The module an import of `target` loads (a name inside a module: that module)."""
    while target not in MODULES and "." in target:
        target = target.rpartition(".")[0]
    return target


def test_no_import_circle():
    edges = {m: {_owner(t) for t, _, _ in imps} - {m} for m, imps in GRAPH.items()}
    # A package's __init__ re-exporting its own modules is not a circle with them.
    for m in edges:
        edges[m] = {t for t in edges[m] if not (MODULES[t].name == "__init__.py" and m.startswith(t + "."))}
    seen, on_path, circles = set(), [], []

    def visit(m):
        if m in on_path:
            circles.append(on_path[on_path.index(m):] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        on_path.append(m)
        for t in sorted(edges[m]):
            visit(t)
        on_path.pop()

    for m in sorted(edges):
        visit(m)
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_no_module_imports_another_modules_private_names():
    bad = [f"{m}:{line} takes {name} from {src}" for m, imps in GRAPH.items() for src, name, line in imps
           if name and name.startswith("_") and not name.startswith("__") and _owner(src) != m]
    assert not bad, "\n".join(bad)


# room -> rooms it must never import (docs/design.md section 2)
NEVER = {
    "colibri.formats": ["colibri.kernels", "colibri.io", "colibri.models", "colibri.plan", "colibri.engine",
                        "colibri.placement", "colibri.cluster", "colibri.serve"],
    "colibri.io": ["colibri.kernels", "colibri.models", "colibri.placement", "colibri.engine", "colibri.serve",
                   "colibri.cluster"],
    "colibri.kernels": ["colibri.models", "colibri.io", "colibri.engine", "colibri.placement", "colibri.serve",
                        "colibri.plan", "colibri.cluster"],
    "colibri.plan": ["colibri.kernels", "colibri.models", "colibri.placement", "colibri.serve"],
    "colibri.models": ["colibri.io", "colibri.engine", "colibri.placement", "colibri.serve", "colibri.cluster"],
    "colibri.serve": ["colibri.models", "colibri.kernels", "colibri.placement"],
}


@pytest.mark.parametrize("room", sorted(NEVER))
def test_rooms_import_one_way(room):
    def inside(m, r):
        return m == r or m.startswith(r + ".")

    bad = [f"{m}:{line} imports {src}" for m, imps in GRAPH.items() if inside(m, room)
           for src, _, line in imps for other in NEVER[room] if inside(src, other)]
    assert not bad, "\n".join(bad)


def _without_numba(code: str, *args: str) -> subprocess.CompletedProcess:
    probe = code + "\nimport sys\nassert 'numba' not in sys.modules and 'llvmlite' not in sys.modules, 'numba imported'\n"
    return subprocess.run([sys.executable, "-c", probe, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


CLI = """
import sys
from colibri.cli import app
try:
    app(sys.argv[1:], prog_name="colibri")
except SystemExit as e:
    assert e.code in (0, None), f"exit {e.code}"
"""


def test_convert_help_runs_without_numba():
    r = _without_numba(CLI, "convert", "--help")
    assert r.returncode == 0, r.stderr
    assert "convert" in r.stdout.lower()


def test_format_readers_and_the_planner_import_without_numba():
    r = _without_numba("import colibri.io.container, colibri.io.convert, colibri.io.gguf_import, colibri.io.fp8, "
                       "colibri.plan, colibri.formats.qtensor, colibri.formats.expert_blob, colibri.info")
    assert r.returncode == 0, r.stderr


def test_plan_runs_without_numba(tmp_path):
    from tools import synthetic_moe

    model = synthetic_moe.write_container(tmp_path / "m", "tiny", progress=False)
    r = _without_numba(CLI, "plan", "-m", str(model), "--ram-gb", "4")
    assert r.returncode == 0, r.stderr
    assert "experts" in r.stdout.lower()
