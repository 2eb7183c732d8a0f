"""The guard that ``mmkey-sglang-guard.pth`` installs: an opted-in process never builds SGLang's
own Mooncake embedding backend. Needs no SGLang: the guard acts on a module name, and the
launcher tests in test_sglang_allowlist.py show it inside SGLang's real loader.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

import _mmkey_sglang_guard as guard
from mmkey.integrations.sglang import _plugin, _store_settings

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard on sys.meta_path for this test, SGLang's backend module not imported, and
    mmkey's plugin not registered; all put back afterwards."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, guard.SGLANG_BACKEND_MODULE, raising=False)
    monkeypatch.setattr(_plugin, "_plugin_errors", None)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    guard.install()


def first_finder() -> guard._Guard:
    """The guard, which `install` put first (SGLang's own import of the module is exercised by
    the launcher tests, where SGLang is installed)."""
    finder = sys.meta_path[0]
    assert isinstance(finder, guard._Guard)
    return finder


def test_the_plugin_reads_the_switch_with_the_guards_own_function() -> None:
    assert _store_settings.opted_in is guard.opted_in
    assert guard._SWITCH == _store_settings.BACKEND_ENV


def test_opted_in_an_unregistered_process_cannot_import_sglangs_backend(
    installed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(guard._SWITCH, "1")
    monkeypatch.setenv("SGLANG_PLUGINS", "other, spare")
    with pytest.raises(guard.UnguardedBackend) as refused:
        first_finder().find_spec(guard.SGLANG_BACKEND_MODULE, None)
    message = str(refused.value)
    assert "MMKEY_SGLANG_BACKEND='1'" in message
    assert "SGLANG_PLUGINS='other, spare' does not list 'mmkey'" in message
    assert "SGLANG_PLUGINS=other,spare,mmkey" in message  # the fix, spelt out
    assert "or unset MMKEY_SGLANG_BACKEND" in message
    assert refused.value.name == guard.SGLANG_BACKEND_MODULE


@pytest.mark.parametrize("plugins", ["", "mmkey", "other,mmkey"])
def test_a_plugin_that_was_allowed_but_did_not_register_is_named_as_the_cause(
    installed: None, monkeypatch: pytest.MonkeyPatch, plugins: str
) -> None:
    monkeypatch.setenv(guard._SWITCH, "1")
    monkeypatch.setenv("SGLANG_PLUGINS", plugins)
    with pytest.raises(guard.UnguardedBackend, match="mmkey's SGLang plugin did not register"):
        first_finder().find_spec(guard.SGLANG_BACKEND_MODULE, None)


def test_once_mmkeys_plugin_registered_or_not_opted_in_the_guard_finds_nothing(
    installed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    finder = first_finder()
    monkeypatch.setenv(guard._SWITCH, "0")
    assert finder.find_spec(guard.SGLANG_BACKEND_MODULE, None) is None  # switched off
    monkeypatch.setenv(guard._SWITCH, "1")
    monkeypatch.setattr(_plugin, "_plugin_errors", [])  # what register_plugin leaves
    assert _plugin.registered()
    assert finder.find_spec(guard.SGLANG_BACKEND_MODULE, None) is None
    monkeypatch.setattr(_plugin, "_plugin_errors", None)
    assert finder.find_spec(guard.SGLANG_BACKEND_MODULE + "_other", None) is None  # other modules
    assert finder.find_spec("sglang.srt.mem_cache.storage", None) is None


def test_installing_twice_puts_one_guard_first(installed: None) -> None:
    guard.install()
    assert isinstance(sys.meta_path[0], guard._Guard)
    assert sum(isinstance(finder, guard._Guard) for finder in sys.meta_path) == 1


def interpreter_start(switch: str | None) -> list[str]:
    """The guard's state in a fresh interpreter of this environment, with the switch given."""
    env = {k: v for k, v in os.environ.items() if k != guard._SWITCH}
    if switch is not None:
        env[guard._SWITCH] = switch
    code = (
        "import sys; print(int('_mmkey_sglang_guard' in sys.modules), "
        "type(sys.meta_path[0]).__name__, int('mmkey' in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # site reports a failing .pth line on stderr
    return done.stdout.split()


def test_the_installed_pth_guards_an_opted_in_interpreter_from_its_start() -> None:
    assert interpreter_start("1") == ["1", "_Guard", "0"]  # installed first, without importing mmkey
    assert interpreter_start("off") == ["1", "_Guard", "0"]  # any value but 0 opts in
    assert interpreter_start(None)[:1] == ["0"]
    assert interpreter_start("0")[:1] == ["0"]
    assert interpreter_start("")[:1] == ["0"]


SPAWNING = """
import multiprocessing, sys

def report(queue):
    queue.put(type(sys.meta_path[0]).__name__)

if __name__ == "__main__":
    context = multiprocessing.get_context(sys.argv[1])
    queue = context.Queue()
    child = context.Process(target=report, args=(queue,))
    child.start()
    print(queue.get(timeout=60))
    child.join(timeout=60)
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_the_encoder_processes_sglang_spawns_are_guarded_from_their_start(
    tmp_path: Path, method: str
) -> None:
    # a TP rank or DP worker is a fresh interpreter of the same environment
    script = tmp_path / "spawning.py"
    script.write_text(SPAWNING)
    env = {**os.environ, guard._SWITCH: "1"}
    done = subprocess.run(
        [sys.executable, str(script), method], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["_Guard"]


def test_the_distribution_ships_the_guard_and_its_pth() -> None:
    files = {str(path): path for path in importlib.metadata.distribution("mmkey").files or []}
    assert "mmkey-sglang-guard.pth" in files
    shipped = Path(str(files["mmkey-sglang-guard.pth"].locate()))
    assert shipped.read_text() == (ROOT / "src" / "mmkey-sglang-guard.pth").read_text()
