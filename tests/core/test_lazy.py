"""`mmkey._lazy.lazy_exports`: names imported from their submodule on first use, then kept."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from mmkey._lazy import lazy_exports


def _package(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    home = types.ModuleType("lazy_pkg._home")
    home.thing = object()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lazy_pkg", types.ModuleType("lazy_pkg"))
    monkeypatch.setitem(sys.modules, "lazy_pkg._home", home)
    return {"__name__": "lazy_pkg", "home": home}


def test_a_name_loads_from_its_home_once_and_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    namespace = _package(monkeypatch)
    getattr_, _ = lazy_exports("lazy_pkg", namespace, {"thing": "_home"}, ["thing"])
    assert "thing" not in namespace
    value = getattr_("thing")
    assert value is namespace["home"].thing
    assert namespace["thing"] is value


def test_an_unknown_name_is_an_attribute_error_naming_the_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    getattr_, _ = lazy_exports("lazy_pkg", _package(monkeypatch), {"thing": "_home"}, ["thing"])
    with pytest.raises(AttributeError, match="'lazy_pkg' has no attribute 'other'"):
        getattr_("other")


def test_dir_lists_exported_names_before_they_load(monkeypatch: pytest.MonkeyPatch) -> None:
    namespace = _package(monkeypatch)
    _, dir_ = lazy_exports("lazy_pkg", namespace, {"thing": "_home"}, ["thing"])
    assert "thing" in dir_() and "thing" not in namespace
