"""`PatchAfterImport`, the finder that patches SGLang's spawning modules when they are imported.

These run without SGLang, on modules written to a temporary folder; test_sglang_plugin.py
runs the whole mechanism against SGLang's own modules and spawned processes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import inspect
import logging
import pickle
import sys
import uuid
from collections.abc import Iterator
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import mmkey.integrations.sglang._spawn as spawn_hook


@pytest.fixture
def isolated_imports(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A folder on ``sys.path`` for throwaway modules; ``sys.meta_path`` restored afterwards."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.syspath_prepend(str(tmp_path))
    names = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - names:
        del sys.modules[name]


def write_module(folder: Path, body: str) -> str:
    name = f"mmkey_probe_{uuid.uuid4().hex}"
    (folder / f"{name}.py").write_text(body)
    importlib.invalidate_caches()
    return name


def test_a_named_module_is_patched_after_it_executes_and_again_on_reload(isolated_imports: Path) -> None:
    name = write_module(isolated_imports, "def launch():\n    return 'original'\n")
    other = write_module(isolated_imports, "VALUE = 1\n")
    seen: list[str] = []

    def patch(module: ModuleType) -> None:
        seen.append(module.launch())
        vars(module)["launch"] = lambda: "patched"

    sys.meta_path.insert(0, spawn_hook.PatchAfterImport({name}, patch))
    module = importlib.import_module(name)
    assert seen == ["original"] and module.launch() == "patched"
    assert "return 'original'" in inspect.getsource(module)  # the module's own loader still answers
    importlib.reload(module)
    assert seen == ["original", "original"] and module.launch() == "patched"
    assert type(importlib.import_module(other).__loader__).__name__ == "SourceFileLoader"


def test_two_finders_for_one_module_both_patch_in_turn(isolated_imports: Path) -> None:
    name = write_module(isolated_imports, "ORDER = []\n")
    sys.meta_path[:0] = [
        spawn_hook.PatchAfterImport({name}, lambda m: m.ORDER.append("first")),
        spawn_hook.PatchAfterImport({name}, lambda m: m.ORDER.append("second")),
    ]
    assert importlib.import_module(name).ORDER == ["second", "first"]  # the inner loader runs first


def test_a_failing_import_is_not_hidden_and_a_failing_patch_does_not_fail_the_import(
    isolated_imports: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = write_module(isolated_imports, "raise ImportError('needs grpc')\n")
    fine = write_module(isolated_imports, "VALUE = 2\n")
    missing = f"mmkey_probe_{uuid.uuid4().hex}"
    calls: list[str] = []

    def patch(module: ModuleType) -> None:
        calls.append(module.__name__)
        raise RuntimeError("patch broke")

    sys.meta_path.insert(0, spawn_hook.PatchAfterImport({broken, fine, missing}, patch))
    with pytest.raises(ImportError, match="needs grpc"):
        importlib.import_module(broken)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(missing)
    assert calls == [] and broken not in sys.modules
    with caplog.at_level(logging.WARNING, logger=spawn_hook.__name__):
        assert importlib.import_module(fine).VALUE == 2
    assert calls == [fine]
    assert f"patching {fine} after its import failed" in caplog.text
    [record] = [r for r in caplog.records if "after its import failed" in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError  # with the traceback


def test_covering_twice_installs_one_finder_and_never_raises(isolated_imports: Path) -> None:
    spawn_hook.cover_spawned_encoders()
    spawn_hook.cover_spawned_encoders()
    finders = [f for f in sys.meta_path if isinstance(f, spawn_hook.PatchAfterImport)]
    assert len(finders) == 1
    assert finders[0].modules == {spawn_hook.RUNTIME_MODULE, spawn_hook.GRPC_MODULE}


def test_the_replacements_pickle_by_reference_to_mmkey() -> None:
    for target in spawn_hook.SPAWN_TARGETS:
        data = pickle.dumps(target.replacement)
        assert f"{spawn_hook.__name__}".encode() in data and b"sglang.srt" not in data
        assert pickle.loads(data) is target.replacement
    assert {(t.module, t.name) for t in spawn_hook.SPAWN_TARGETS} == {
        (spawn_hook.RUNTIME_MODULE, "launch_encoder"),
        (spawn_hook.RUNTIME_MODULE, "launch_dp_worker"),
        (spawn_hook.GRPC_MODULE, "launch_encoder"),
    }


def test_only_code_that_names_load_plugins_loads_plugins_itself() -> None:
    """A target without code (None, a builtin) or whose code never names it does not."""
    namespace: dict[str, Any] = {}
    exec("def patched():\n    load_plugins()\n\ndef plain():\n    return 1\n", namespace)
    assert spawn_hook.loads_plugins_itself(namespace["patched"])
    assert not spawn_hook.loads_plugins_itself(namespace["plain"])
    assert not spawn_hook.loads_plugins_itself(None)
    assert not spawn_hook.loads_plugins_itself(len)


def mmkeys_finders() -> list[spawn_hook.PatchAfterImport]:
    return [
        f
        for f in sys.meta_path
        if isinstance(f, spawn_hook.PatchAfterImport)
        and f.modules == {spawn_hook.RUNTIME_MODULE, spawn_hook.GRPC_MODULE}
    ]


def test_mmkeys_finder_goes_first_and_another_patching_finder_is_not_taken_for_it(
    isolated_imports: Path,
) -> None:
    other = spawn_hook.PatchAfterImport({"mmkey_probe_other"}, lambda module: None)
    sys.meta_path.insert(0, other)
    spawn_hook.cover_spawned_encoders()
    [ours] = mmkeys_finders()
    assert sys.meta_path[:2] == [ours, other]


def test_a_finder_without_find_spec_is_passed_over(isolated_imports: Path) -> None:
    """Python's import system skips such a finder; so does the patching finder's own search."""
    name = write_module(isolated_imports, "VALUE = 3\n")
    seen: list[str] = []
    bare: Any = object()  # no find_spec
    sys.meta_path[:0] = [spawn_hook.PatchAfterImport({name}, lambda m: seen.append(m.__name__)), bare]
    assert importlib.import_module(name).VALUE == 3
    assert seen == [name]


def test_a_loader_that_creates_its_module_still_creates_it_when_wrapped(isolated_imports: Path) -> None:
    name = f"mmkey_probe_{uuid.uuid4().hex}"

    class Creating(importlib.abc.Loader):
        def create_module(self, spec: ModuleSpec) -> ModuleType:
            module = ModuleType(spec.name)
            module.MADE_BY = "loader"  # type: ignore[attr-defined]
            return module

        def exec_module(self, module: ModuleType) -> None:
            module.EXECUTED = True  # type: ignore[attr-defined]

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
            return ModuleSpec(fullname, Creating()) if fullname == name else None

    def patch(module: ModuleType) -> None:
        module.PATCHED = True  # type: ignore[attr-defined]

    sys.meta_path[:0] = [spawn_hook.PatchAfterImport({name}, patch), Finder()]
    module = importlib.import_module(name)
    assert (module.MADE_BY, module.EXECUTED, module.PATCHED) == ("loader", True, True)


def test_a_spawning_module_imported_unpatched_names_the_finders_ahead_of_mmkeys(
    isolated_imports: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`check_coverage` names every finder ahead of mmkey's, another patching finder included."""

    def launch_encoder() -> None:
        """SGLang's target, as a finder ahead of mmkey's leaves it."""

    monkeypatch.setattr(spawn_hook, "_problems", {})
    runtime = ModuleType(spawn_hook.RUNTIME_MODULE)
    vars(runtime).update(launch_encoder=launch_encoder, launch_dp_worker=spawn_hook.launch_dp_worker)
    monkeypatch.setitem(sys.modules, spawn_hook.RUNTIME_MODULE, runtime)
    monkeypatch.delitem(sys.modules, spawn_hook.GRPC_MODULE, raising=False)
    ahead = spawn_hook.PatchAfterImport({"mmkey_probe_ahead"}, lambda module: None)
    sys.meta_path[:0] = [ahead, spawn_hook.PatchAfterImport(set(), spawn_hook._patch)]
    [problem] = spawn_hook.check_coverage()
    assert f"(finders ahead of mmkey's on sys.meta_path: {ahead!r})" in problem
