"""Every public error derives from `MMKeyError` and lives in `mmkey.errors`, whose docstring
draws the tree the classes really form."""

from __future__ import annotations

import ast
import builtins
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import mmkey
import mmkey.errors

SRC = Path(mmkey.__file__).parent
STACKS = ("vllm", "sglang")
"""Stacks whose absence may keep a public name from loading in this environment."""


def _public_modules() -> list[str]:
    names = ["mmkey", *(m.name for m in pkgutil.walk_packages(mmkey.__path__, "mmkey."))]
    return [n for n in names if not any(part.startswith("_") for part in n.split("."))]


def _exported_exceptions() -> dict[str, list[type[BaseException]]]:
    """Each exception class a public module exports, by the module that exports it."""
    found: dict[str, list[type[BaseException]]] = {}
    for name in _public_modules():
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", ()):
            try:
                value = getattr(module, attr)
            except ModuleNotFoundError as exc:  # a stack this environment lacks
                if (exc.name or "").split(".")[0] in STACKS:
                    continue
                raise
            if isinstance(value, type) and issubclass(value, BaseException):
                found.setdefault(name, []).append(value)
    return found


def test_every_exported_exception_derives_from_mmkey_error_and_is_mmkey_errors_own() -> None:
    found = _exported_exceptions()
    assert {"mmkey", "mmkey.errors", "mmkey.integrations.sglang", "mmkey.testing.fleet"} <= set(found)
    for module, classes in found.items():
        for cls in classes:
            assert issubclass(cls, mmkey.errors.MMKeyError), f"{module}.{cls.__name__}"
            assert cls.__module__ == "mmkey.errors", f"{module}.{cls.__name__} is defined in {cls.__module__}"
            assert getattr(mmkey.errors, cls.__name__) is cls
            assert cls.__name__ in mmkey.errors.__all__


def test_no_module_but_errors_defines_a_public_exception_class() -> None:
    exceptions = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)}
    exceptions = {n for n in exceptions if issubclass(getattr(builtins, n), BaseException)}
    exceptions |= set(mmkey.errors.__all__)
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name == "errors.py" and path.parent == SRC:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
                if bases & exceptions:
                    offenders.append(f"{path.relative_to(SRC)}: {node.name}")
    assert not offenders, "define public errors in mmkey/errors.py: " + ", ".join(offenders)


def _drawn_tree() -> list[tuple[int, str, list[str]]]:
    doc = mmkey.errors.__doc__ or ""
    block = doc.split("::\n\n", 1)[1].split("\n\n", 1)[0]
    rows = []
    for line in block.splitlines():
        match = re.fullmatch(r"( *)(\w+)(?: \[(.+)\])?", line)
        assert match, line
        indent, name, extra = match.groups()
        rows.append((len(indent), name, extra.split(", ") if extra else []))
    return rows


def test_the_docstring_draws_the_real_tree() -> None:
    rows = _drawn_tree()
    parents: dict[int, type[BaseException]] = {}
    drawn = set()
    for depth, name, extra in rows:
        cls = getattr(mmkey.errors, name)
        drawn.add(cls)
        if depth == 4:
            assert cls is mmkey.errors.MMKeyError
        else:
            assert cls.__bases__[0] is parents[depth - 4], name
        assert [b.__name__ for b in cls.__bases__[1:]] == extra, name
        parents[depth] = cls
    classes = {getattr(mmkey.errors, n) for n in mmkey.errors.__all__}
    assert drawn == {c for c in classes if isinstance(c, type) and issubclass(c, BaseException)}


@pytest.mark.parametrize(
    ("old_home", "name", "also"),
    [
        ("mmkey._deadline", "CallTimeout", None),
        ("mmkey.cache.mooncake._transport", "TransferFailed", None),
        ("mmkey.integrations.sglang", "SGLangConfigError", ValueError),
        ("mmkey.integrations.sglang._store_settings", "SGLangConfigError", ValueError),
        ("mmkey.integrations.sglang._pools", "UnknownBuffer", ValueError),
        ("mmkey.testing.mooncake_master", "MasterStartError", RuntimeError),
        ("mmkey.testing.fleet", "FleetStartError", RuntimeError),
        ("mmkey.testing.fleet", "ShapingUnavailable", RuntimeError),
    ],
)
def test_the_old_import_paths_and_bases_still_work(old_home: str, name: str, also: type | None) -> None:
    cls = getattr(importlib.import_module(old_home), name)
    assert cls is getattr(mmkey.errors, name)
    if also is not None:
        assert issubclass(cls, also)
