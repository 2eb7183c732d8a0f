"""Our stubs of vLLM (stubs/vllm) against the installed vLLM: every stubbed name exists.

For each stubbed module, class, function and method: the real one exists; every parameter
the stub declares is accepted by the real signature; every attribute the stub declares is
a class attribute, a dataclass field or assigned in the real class's source.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

STUBS = Path(__file__).resolve().parents[3] / "stubs" / "vllm"
STUB_FILES = sorted(STUBS.rglob("*.pyi"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(STUBS.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def accepts(real: Any, stub: ast.FunctionDef) -> list[str]:
    """Stub parameters the real callable does not accept."""
    try:
        signature = inspect.signature(real)
    except (TypeError, ValueError):
        return []  # a builtin without a signature: nothing to compare
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    declared = [a.arg for a in stub.args.posonlyargs + stub.args.args + stub.args.kwonlyargs]
    return [name for name in declared if name not in ("self", "cls") and name not in params]


def has_attribute(cls: type, name: str) -> bool:
    if hasattr(cls, name) or name in getattr(cls, "__dataclass_fields__", {}):
        return True
    if name in getattr(cls, "__struct_fields__", ()) or name in getattr(cls, "model_fields", {}):
        return True
    for klass in cls.__mro__:
        if name in klass.__dict__.get("__annotations__", {}):
            return True
        try:
            if f"self.{name} =" in inspect.getsource(klass) or f"self.{name}:" in inspect.getsource(klass):
                return True
        except (OSError, TypeError):
            continue
    return False


def check_class(real: type, node: ast.ClassDef, where: str) -> list[str]:
    problems = []
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            if not hasattr(real, item.name):
                problems.append(f"{where}.{item.name} is missing")
                continue
            member = getattr(real, item.name)
            if isinstance(member, property) or item.name == "__init__" and member is object.__init__:
                continue
            problems += [f"{where}.{item.name}() takes no {p!r}" for p in accepts(member, item)]
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            if not has_attribute(real, item.target.id):
                problems.append(f"{where}.{item.target.id} is not an attribute")
        elif isinstance(item, ast.Assign):
            for target in item.targets:
                if isinstance(target, ast.Name) and not hasattr(real, target.id):
                    problems.append(f"{where}.{target.id} is missing")
    return problems


@pytest.mark.parametrize("path", STUB_FILES, ids=lambda p: module_name(p))
def test_stubbed_names_exist_in_vllm(path: Path) -> None:
    module = importlib.import_module(module_name(path))
    tree = ast.parse(path.read_text())
    problems: list[str] = []
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            where = f"{module.__name__}.{node.name}"
            if not hasattr(module, node.name):
                problems.append(f"{where} is missing")
            elif isinstance(node, ast.ClassDef):
                problems += check_class(getattr(module, node.name), node, where)
            else:
                problems += [f"{where}() takes no {p!r}" for p in accepts(getattr(module, node.name), node)]
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and not hasattr(module, node.target.id)
        ):
            problems.append(f"{module.__name__}.{node.target.id} is missing")
    assert problems == []


def test_every_stub_file_was_checked() -> None:
    assert len(STUB_FILES) >= 10
