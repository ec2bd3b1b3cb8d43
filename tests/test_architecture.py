"""The package's shape, checked where CI runs: the layers contract of ``pyproject.toml`` (import-linter), no
import cycle anywhere inside ``sbp_torch``, no import inside a function body (but the optional, heavy ones
named below), the budget of code lines, no code that asks whether its tensors are fake, and ruff's lint and
format."""

from __future__ import annotations

import ast
import io
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sbp_torch"
# Lines of code in sbp_torch/: docstrings, comments and blank lines are not counted, so that saying why never
# competes with the code for room. It catches bloat; a feature that needs lines raises it, and code is never
# packed to fit it.
CODE_LINE_BUDGET = 12100

# module -> the modules it may import inside a function: optional or heavy, needed by one rarely used path
LATE_IMPORTS = {
    "sbp_torch/kernels/_extension.py": {"torch", "torch.utils.cpp_extension"},  # setup.py reads it without torch
    "sbp_torch/pipeline/_timeline.py": {"matplotlib", "matplotlib.pyplot"},  # an optional dependency
    "sbp_torch/_api/_gradient_reducer.py": {"torch._inductor.config"},  # slow; needed once a model is laid out
    # slow; once a step compiles
    "sbp_torch/_api/_compile_step.py": {"torch._dynamo", "torch._inductor.config", "torch._inductor.decomposition"},
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


def code_lines(source: str) -> int:
    """The lines of ``source`` that hold code: not blank, not only a comment, not part of a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in layout:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def test_code_line_budget():
    lines = sum(code_lines(path.read_text()) for path in PACKAGE.rglob("*.py"))
    assert lines <= CODE_LINE_BUDGET, f"sbp_torch/ holds {lines} lines of code; the budget is {CODE_LINE_BUDGET}"


def test_code_lines_count_code_only():
    source = '''"""A module docstring,
over two lines."""

# a comment
def f(x):
    """Its docstring."""
    return (x +  # a comment after code
            1)
'''
    assert code_lines(source) == 3


# Names that ask whether a tensor is fake. A step traced into a program runs on fake parts, as ``explain`` does:
# code that takes another path on fake parts puts that path into the program (an experts region once gave zeros
# under compile_step). What may differ is said by ``comm.estimating()`` and ``comm.compiling()``.
_ASKS_IF_FAKE = {"is_fake", "FakeTensor", "maybe_get_fake_mode", "is_fake_tensor"}


# Names that read another function's local variables: renaming a local or moving a file would change what such
# code sees, silently (explain once named causes so). Code that knows a fact hands it on: a context variable, an
# argument (``_comm.caused_by`` names a collective's cause).
_READS_LOCALS = {"f_locals", "getouterframes", "currentframe"}


def _names_used(names: set) -> list[str]:
    used = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name in names:
                used.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    return used


def test_no_code_asks_whether_its_tensors_are_fake():
    asking = _names_used(_ASKS_IF_FAKE)
    assert not asking, "\n".join(asking)


def test_no_code_reads_the_locals_of_other_frames():
    reading = _names_used(_READS_LOCALS)
    assert not reading, "\n".join(reading)


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    done = subprocess.run([_tool("ruff"), *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def _imports_of(folder: str, packages: tuple[str, ...]) -> list[str]:
    """The places in ``folder``'s Python files that import one of ``packages`` (or a module inside one)."""
    importing = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] in packages for n in names):
                importing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return importing


def test_no_test_imports_a_benchmark_or_a_diagnostic():
    """Benchmarks time and diagnostics check; what tests share with them (models, layouts) lives in ``zoo/``."""
    importing = _imports_of("tests", ("benchmarks", "diagnostics"))
    assert not importing, importing


def test_no_benchmark_imports_a_diagnostic():
    """Diagnostics may use the benchmarks' harness (timers, tables, the output folder); a benchmark needs no
    diagnostic."""
    importing = _imports_of("benchmarks", ("diagnostics",))
    assert not importing, importing
