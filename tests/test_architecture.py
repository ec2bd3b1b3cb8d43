"""The package's shape, checked where CI runs: the layers contract of ``pyproject.toml`` (import-linter), no
import cycle anywhere inside ``sbp_torch``, no import inside a function body (but the optional, heavy ones
named below), the line budget, and ruff's lint and format."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sbp_torch"
LINE_BUDGET = 15960  # lines of Python in sbp_torch/, blank lines and docstrings included; raised only for a feature

# module -> the modules it may import inside a function: optional or heavy, needed by one rarely used path
LATE_IMPORTS = {
    "sbp_torch/kernels/_extension.py": {"torch", "torch.utils.cpp_extension"},  # setup.py reads it without torch
    "sbp_torch/pipeline/_timeline.py": {"matplotlib", "matplotlib.pyplot"},  # an optional dependency
    "sbp_torch/_api/_gradient_reducer.py": {"torch._inductor.config"},  # slow; needed once a model is laid out
    "sbp_torch/_api/_compile_step.py": {"torch._dynamo", "torch._inductor.config"},  # slow; once a step compiles
    # slow (Dynamo, Inductor); needed once a program compiles
    "sbp_torch/_comm/_compiled.py": {
        "torch._dynamo.callback",
        "torch._inductor.config",
        "torch._functorch.partitioners",
        "torch._inductor.custom_graph_pass",
        "torch.utils.checkpoint",
    },
}


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: it comes with the test extras (pip install -e '.[test]')")
    return found


def test_layers_contract_holds():
    done = subprocess.run([_tool("lint-imports")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _cycle(graph) -> list[str] | None:
    """One import cycle among the modules of ``graph``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if state.get(imported) == 1:
                return path[path.index(imported) :] + [imported]
            if imported in graph.modules and imported not in state:
                found = visit(imported)
                if found:
                    return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph.modules):
        if module not in state:
            found = visit(module)
            if found:
                return found
    return None


def test_no_import_cycles():
    cycle = _cycle(grimp.build_graph("sbp_torch"))
    assert cycle is None, " -> ".join(cycle)


def test_imports_are_at_the_top():
    late = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        modules = {a.name for a in inner.names} if isinstance(inner, ast.Import) else {inner.module}
                        if not modules <= LATE_IMPORTS.get(name, set()):
                            late.append(f"{name}:{inner.lineno} imports {sorted(modules)} in {node.name}()")
    assert not late, "\n".join(late)


def test_line_budget():
    lines = sum(len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py"))
    assert lines <= LINE_BUDGET, f"sbp_torch/ holds {lines} lines of Python; the budget is {LINE_BUDGET}"


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    done = subprocess.run([_tool("ruff"), *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
