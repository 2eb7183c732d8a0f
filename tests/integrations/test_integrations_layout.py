"""The integration packages' shape (no stack needed): lazy ``__init__`` re-exports, import
cost, and module dependencies without a cycle."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mmkey.integrations

ROOT = Path(mmkey.integrations.__file__).parent
STACKS = ("vllm", "sglang")
# the stacks, the binding, and mmkey's Mooncake client (its package and config load with `mmkey`)
HEAVY = {"torch", "vllm", "sglang", "mooncake", "mmkey.cache.mooncake._cache"}


def imported_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "statement",
    [
        "import mmkey.integrations.vllm",
        "import mmkey.integrations.sglang",
        "import mmkey.integrations.sglang._spawn",  # what a spawned SGLang child imports first
        "from mmkey.integrations.sglang import sglang_key, namespace_from_env",
        "from mmkey.integrations.vllm import namespace_from_vllm_config",
        "import mmkey.integrations.vllm._connector_settings",
    ],
)
def test_importing_a_package_or_its_stack_free_parts_loads_no_stack(statement: str) -> None:
    loaded = imported_after(statement)
    assert not loaded & HEAVY, loaded & HEAVY
    assert statement.split()[1] in loaded  # the control: the import did happen


def test_a_public_name_loads_its_module_on_first_use() -> None:
    loaded = imported_after("import mmkey.integrations.sglang as s\ns.sglang_key")
    assert "mmkey.integrations.sglang._keys" in loaded
    assert "mmkey.integrations.sglang._store" not in loaded


@pytest.mark.parametrize("stack", STACKS)
def test_every_public_name_has_a_home_and_a_misspelt_one_is_an_attribute_error(stack: str) -> None:
    package = importlib.import_module(f"mmkey.integrations.{stack}")
    homes: dict[str, str] = package._HOMES
    assert sorted(homes) == sorted(package.__all__)
    for name, home in homes.items():
        source = (ROOT / stack / f"{home}.py").read_text()
        assert name in {
            n.name for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.ClassDef, ast.FunctionDef))
        } | {
            t.id
            for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Name)
        } | {  # re-exported there, as the errors are from mmkey.errors
            a.asname or a.name
            for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.ImportFrom)
            for a in n.names
        }, f"{name} is not defined in {stack}/{home}.py"
    assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="no attribute 'MMKeyConnector'"):
        _ = package.MMKeyConnector


def run_time_imports(path: Path) -> set[str]:
    """The mmkey modules `path` imports at run time (in functions too; not for type checkers)."""
    tree = ast.parse(path.read_text())
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mmkey"):
            found.update(
                f"{node.module}.{a.name}" if node.module in PACKAGES else node.module for a in node.names
            )
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("mmkey"))
    return found


PACKAGES = {f"mmkey.integrations.{stack}" for stack in STACKS}


@pytest.mark.parametrize("stack", STACKS)
def test_no_import_cycle_and_no_other_stack(stack: str) -> None:
    package = f"mmkey.integrations.{stack}"
    graph = {
        f"{package}.{path.stem}": {m for m in run_time_imports(path) if m.startswith(package + ".")}
        for path in (ROOT / stack).glob("_*.py")
    }
    for module in graph:
        other = {
            m
            for m in run_time_imports(ROOT / stack / f"{module.rsplit('.', 1)[1]}.py")
            if m.startswith("mmkey.integrations.")
        }
        assert not {
            m for m in other if any(m.startswith(f"mmkey.integrations.{s}") for s in STACKS if s != stack)
        }
        assert package not in other, f"{module} imports its package's __init__"
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join((*path, module))}"
        if module in done:
            return
        for target in graph.get(module, ()):
            visit(target, (*path, module))
        done.add(module)

    for module in graph:
        visit(module, ())
    assert graph  # the control: the package's modules were read


@pytest.mark.parametrize("stack", STACKS)
def test_every_test_file_that_needs_its_stack_runs_in_the_stacks_environment(stack: str) -> None:
    """A test file that skips without its stack runs only where `make test` names it (the stack's
    environment), or, marked `gpu`, in ``scripts/gpu-check.sh``; one left out would skip
    everywhere and guard nothing."""
    tests = Path(__file__).parent / stack
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    needing = {p.name: p.read_text() for p in sorted(tests.glob("test_*.py"))}
    needing = {name: text for name, text in needing.items() if f"require_{stack}()" in text}
    assert needing  # the control: the stack's tests were read
    named = set(re.findall(r"(?<!\w)test_\w+\.py", makefile))  # (whole names: not inside a longer one)
    left_out = [name for name, text in needing.items() if name not in named and "mark.gpu" not in text]
    assert left_out == []
