"""`HolderSpec` and `find_holder_binary` on their own: the checks of every field, the command
line, and where the binary is looked for (the package first, then beside Python, then PATH)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mmkey.cache.mooncake import holder
from mmkey.cache.mooncake.holder import HOLDER_BINARY, HolderSpec, find_holder_binary

MASTER = "127.0.0.1:50051"


def test_the_default_holder_lends_512_mib_on_mooncakes_default_port() -> None:
    argv = HolderSpec(master_server_address=MASTER).argv("/opt/mooncake_client")
    assert "--port=50052" in argv  # mooncake_client's own default service port
    assert f"--global_segment_size={512 << 20}" in argv
    assert not any(arg.startswith(("--device_names", "--enable_http_server", "--http_port")) for arg in argv)


@pytest.mark.parametrize("port", [1, 65535])
def test_the_ends_of_the_port_range_are_accepted(port: int) -> None:
    spec = HolderSpec(master_server_address=MASTER, port=port, http_port=port)
    assert spec.argv("/b")[-2:] == ["--enable_http_server=true", f"--http_port={port}"]


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"port": 0}, ValueError, "1..65535"),
        ({"port": 65536}, ValueError, "1..65535"),
        ({"port": True}, TypeError, "port number"),
        ({"port": "50052"}, TypeError, "port number"),
        ({"http_port": 0}, ValueError, "http_port must be in 1..65535"),
        ({"http_port": 70000}, ValueError, "http_port must be in 1..65535"),
        ({"global_segment_size": 0}, ValueError, "> 0"),
        ({"global_segment_size": True}, TypeError, "parse_size"),
        ({"local_hostname": ""}, TypeError, "without spaces"),
        ({"local_hostname": "my host"}, TypeError, "without spaces"),
        ({"protocol": 5}, TypeError, "without spaces"),
        ({"metadata_server": " "}, TypeError, "without spaces"),
    ],
)
def test_bad_fields_are_clear_errors(fields: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        HolderSpec(master_server_address=MASTER, **fields)


def test_a_small_segment_and_one_letter_names_are_accepted() -> None:
    spec = HolderSpec(master_server_address=MASTER, global_segment_size=1, local_hostname="h", protocol="x")
    assert spec.argv("/b")[1] == "--host=h"


def test_the_spec_is_a_keyword_only_slotted_record() -> None:
    with pytest.raises(TypeError):
        HolderSpec(MASTER)  # type: ignore[call-arg]
    assert not hasattr(HolderSpec(master_server_address=MASTER), "__dict__")


def executable(folder: Path, mode: int = 0o755) -> str:
    path = folder / HOLDER_BINARY
    path.write_text("#!/bin/sh\n")
    path.chmod(mode)
    return str(path)


def test_the_binary_inside_the_package_comes_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    inside = executable(tmp_path)
    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setattr(shutil, "which", lambda *a, **k: "/elsewhere/mooncake_client")
    assert find_holder_binary() == inside
    assert HolderSpec(master_server_address=MASTER).argv()[0] == inside


def test_a_file_in_the_package_that_cannot_run_is_passed_over(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    executable(tmp_path, mode=0o644)
    spec = SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    assert find_holder_binary() is None


def test_beside_python_then_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    found: dict[str | None, str | None] = {os.path.dirname(sys.executable): "/venv/bin/mooncake_client"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(shutil, "which", lambda name, path=None: found.get(path))
    assert find_holder_binary() == "/venv/bin/mooncake_client"  # beside Python; PATH has none
    found = {None: "/usr/bin/mooncake_client"}
    assert find_holder_binary() == "/usr/bin/mooncake_client"


def test_without_a_binary_the_command_line_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holder, "find_holder_binary", lambda: None)
    spec = HolderSpec(master_server_address=MASTER)
    with pytest.raises(FileNotFoundError, match="mmkey\\[mooncake-cpu\\]"):
        spec.argv()
    assert spec.argv("/given")[0] == "/given"
