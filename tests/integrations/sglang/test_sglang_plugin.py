"""The SGLang plugin: SGLang's own loader finds mmkey's entry point; only the switch changes anything.

Runs in SGLang's environment with mmkey installed (its entry point registered); skips
elsewhere unless MMKEY_REQUIRE_SGLANG=1.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import _mmkey_sglang_guard
from tests.integrations.sglang.sglang_support import require_sglang

require_sglang()

import sglang.srt.plugins as plugins  # noqa: E402
from sglang.srt.disaggregation.encoder.server import MMEncoder  # noqa: E402
from sglang.srt.mem_cache.embedding_cache_controller import EmbeddingCacheController  # noqa: E402
from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

import mmkey.integrations.sglang._caller_hashes as caller_hashes  # noqa: E402
import mmkey.integrations.sglang._io_loop as io_loop  # noqa: E402
import mmkey.integrations.sglang._plugin as integration  # noqa: E402
import mmkey.integrations.sglang._spawn as spawn_hook  # noqa: E402
from mmkey.integrations.sglang import BACKEND_ENV, MMKeyEmbeddingStore, SGLangConfigError  # noqa: E402
from mmkey.testing.mooncake_master import MasterProcess  # noqa: E402

SGLANG_MOONCAKE = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_embedding_store"


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """SGLang's plugin loader and backend registry as in a new process, restored afterwards
    (with ``sys.meta_path`` and the encoder's spawn targets, which the plugin may patch)."""
    monkeypatch.setattr(EmbeddingStoreFactory, "_registry", dict(EmbeddingStoreFactory._registry))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for target in spawn_hook.SPAWN_TARGETS:
        if target.module in sys.modules and hasattr(sys.modules[target.module], target.name):
            monkeypatch.setattr(
                sys.modules[target.module], target.name, getattr(sys.modules[target.module], target.name)
            )
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.setattr(integration, "_plugin_errors", None)
    # the hooks a loaded plugin registers and applies, undone afterwards
    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(caller_hashes, "_installed", False)
    monkeypatch.setattr(MMEncoder, "_prepare_encode_context", MMEncoder._prepare_encode_context)
    monkeypatch.setattr(io_loop, "_installed", False)
    monkeypatch.setattr(EmbeddingCacheController, "_io_loop", EmbeddingCacheController._io_loop)
    monkeypatch.setattr(spawn_hook, "_problems", {})
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.delenv("SGLANG_HICACHE_MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.delenv("MMKEY_SGLANG_HASH", raising=False)
    monkeypatch.setenv("MMKEY_NAMESPACE", "plugin-model")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:1")  # never reached: construction refuses first
    # what the .pth does at an opted-in interpreter's start (this one started without the switch)
    _mmkey_sglang_guard.install()
    yield monkeypatch


def module_of(name: str) -> object:
    return EmbeddingStoreFactory._registry[name]["module_path"]


def test_sglang_discovers_the_entry_point(fresh_loader: pytest.MonkeyPatch) -> None:
    found = plugins.load_plugins_by_group(plugins.GENERAL_PLUGINS_GROUP)
    assert "mmkey" in found
    func, dist = found["mmkey"]
    assert getattr(func, "__qualname__", None) == "register_plugin"
    assert dist == "mmkey"


def test_installed_but_not_switched_on_changes_nothing(fresh_loader: pytest.MonkeyPatch) -> None:
    plugins.load_plugins()
    assert module_of("mooncake") == SGLANG_MOONCAKE
    assert "mmkey" not in EmbeddingStoreFactory._registry
    fresh_loader.setattr(plugins, "_plugins_loaded", False)
    fresh_loader.setenv(BACKEND_ENV, "0")
    plugins.load_plugins()
    assert module_of("mooncake") == SGLANG_MOONCAKE


def test_switch_makes_the_mooncake_backend_name_create_mmkeys_store(
    fresh_loader: pytest.MonkeyPatch, mooncake_master_session: MasterProcess
) -> None:
    fresh_loader.setenv(BACKEND_ENV, "1")
    fresh_loader.setenv("MOONCAKE_MASTER", mooncake_master_session.address)
    fresh_loader.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "16MB")
    fresh_loader.setenv("MOONCAKE_LOCAL_BUFFER_SIZE", "16MB")
    plugins.load_plugins()
    assert module_of("mooncake") == module_of("mmkey") == "mmkey.integrations.sglang"
    store = EmbeddingStoreFactory.create_backend("mooncake")  # what the encode server calls
    try:
        assert isinstance(store, MMKeyEmbeddingStore)
        assert store.namespace == "plugin-model"
    finally:
        store.close()  # type: ignore[attr-defined]


def test_opted_in_without_the_guard_on_the_import_system_the_store_refuses_to_start(
    fresh_loader: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    guardless = [finder for finder in sys.meta_path if not isinstance(finder, _mmkey_sglang_guard._Guard)]
    fresh_loader.setattr(sys, "meta_path", guardless)
    assert not _mmkey_sglang_guard.installed()
    fresh_loader.setenv(BACKEND_ENV, "1")
    plugins.load_plugins()
    assert module_of("mooncake") == "mmkey.integrations.sglang"  # registered, yet refuses
    with pytest.raises(SGLangConfigError, match="mmkey-sglang-guard.pth is not on sys.meta_path") as refused:
        EmbeddingStoreFactory.create_backend("mooncake")
    assert "_mmkey_sglang_guard.install()" in str(refused.value)  # the fix, spelt out
    _mmkey_sglang_guard.install()  # the guard put in place at the start: the refusal goes
    assert integration.guard_problems() == []


GUARDLESS_START = """
import json, sys
import sglang.srt.plugins as plugins
from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory
import _mmkey_sglang_guard
report = {"guard": _mmkey_sglang_guard.installed(), "no_site": sys.flags.no_site}
plugins.load_plugins()
try:
    EmbeddingStoreFactory.create_backend("mooncake")
except Exception as exc:
    report["refused"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(report))
"""


def guardless_layout(tmp_path: Path, layout: str) -> tuple[list[str], dict[str, str]]:
    """An opted-in interpreter that starts with no ``.pth`` of mmkey's run: ``-S`` in this
    environment, or a PYTHONPATH-only layout (a bare virtual environment with this one's
    site-packages and mmkey's source named on ``PYTHONPATH``, whose ``.pth`` files Python never
    runs), as ``pip install --target`` leaves it."""
    site_packages = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "sglang").is_dir())
    env = {**os.environ, BACKEND_ENV: "1", "MMKEY_NAMESPACE": "guardless", "MOONCAKE_PROTOCOL": "tcp"}
    env.update(MOONCAKE_MASTER="127.0.0.1:1", SGLANG_PLUGINS="mmkey")
    source = str(Path(integration.__file__).resolve().parents[3])  # the tree mmkey runs from
    if layout == "python -S":
        env["PYTHONPATH"] = os.pathsep.join([source, site_packages])
        return [sys.executable, "-S", "-c", GUARDLESS_START], env
    bare = tmp_path / "bare"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120, env=env
    )
    env["PYTHONPATH"] = os.pathsep.join([source, site_packages])
    return [str(bare / "bin" / "python"), "-c", GUARDLESS_START], env


@pytest.mark.parametrize("layout", ["python -S", "PYTHONPATH only"])
def test_an_opted_in_interpreter_that_started_without_the_guard_refuses_with_the_fix(
    tmp_path: Path, layout: str
) -> None:
    command, env = guardless_layout(tmp_path, layout)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["guard"] is False
    assert report["no_site"] == (1 if layout == "python -S" else 0)
    assert "SGLangConfigError" in report["refused"]
    assert "mmkey-sglang-guard.pth is not on sys.meta_path" in report["refused"]
    assert "pip install, not --target" in report["refused"]


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (BACKEND_ENV, "false", f"{BACKEND_ENV}='false' is not a value mmkey reads as on"),
        (BACKEND_ENV, " 0", "set MMKEY_SGLANG_BACKEND=1"),
        ("MMKEY_NAMESPACE", "", "MMKEY_NAMESPACE is not set"),
        ("MMKEY_SGLANG_HASH", "sha256", "MMKEY_SGLANG_HASH=blake3"),
        ("MOONCAKE_MASTER", "", "set MOONCAKE_MASTER=host:port"),
        ("MOONCAKE_PROTOCOL", "carrier-pigeon", "protocol must be one of"),
    ],
)
def test_once_opted_in_a_configuration_error_makes_the_encoder_refuse_to_start(
    fresh_loader: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    variable: str,
    value: str,
    message: str,
) -> None:
    fresh_loader.setenv(BACKEND_ENV, "1")
    fresh_loader.setenv(variable, value)
    with caplog.at_level(logging.ERROR):
        plugins.load_plugins()
    assert "Failed to execute general plugin" not in caplog.text
    assert message in caplog.text  # said at ERROR when the plugin loads
    assert module_of("mooncake") == "mmkey.integrations.sglang"  # never SGLang's unverified backend
    with pytest.raises(SGLangConfigError, match="refuses to start") as refused:
        EmbeddingStoreFactory.create_backend("mooncake")  # what the encode server calls
    assert message in str(refused.value)


@pytest.mark.parametrize("version", ["0.5.22", "0.5.24", "0.6.0", "unknown"])
def test_an_sglang_version_outside_the_tested_range_refuses_to_start(
    fresh_loader: pytest.MonkeyPatch, version: str
) -> None:
    import sglang

    fresh_loader.setattr(sglang, "__version__", version)
    fresh_loader.setenv(BACKEND_ENV, "yes")
    plugins.load_plugins()
    assert module_of("mooncake") == "mmkey.integrations.sglang"
    with pytest.raises(SGLangConfigError, match=f"SGLang {version} is outside .* install sglang==0.5.23"):
        EmbeddingStoreFactory.create_backend("mooncake")


def test_the_tested_version_is_the_installed_one() -> None:
    import sglang

    from mmkey.integrations.sglang._store_settings import check_sglang_version

    check_sglang_version(sglang.__version__)  # the environment tests the version the extra allows


# -- the encoder processes SGLang spawns (TP ranks above 0, DP workers) -----------------------

PROBE = Path(__file__).with_name("sglang_spawn_probe.py")


@pytest.fixture
def encoder_modules(fresh_loader: pytest.MonkeyPatch) -> Iterator[tuple[ModuleType, ModuleType, ModuleType]]:
    """SGLang's encoder server, runtime and gRPC server modules; their spawn targets and
    ``sys.meta_path`` are restored afterwards."""
    server = importlib.import_module(spawn_hook.SERVER_MODULE)
    runtime = importlib.import_module(spawn_hook.RUNTIME_MODULE)
    grpc_server = importlib.import_module(spawn_hook.GRPC_MODULE)
    for target in spawn_hook.SPAWN_TARGETS:
        module = sys.modules[target.module]
        fresh_loader.setattr(module, target.name, getattr(module, target.name))
    yield server, runtime, grpc_server


def mmkey_finders() -> list[object]:
    return [f for f in sys.meta_path if isinstance(f, spawn_hook.PatchAfterImport)]


def test_switch_on_makes_sglangs_spawning_modules_start_mmkeys_entry_points(
    fresh_loader: pytest.MonkeyPatch, encoder_modules: tuple[ModuleType, ModuleType, ModuleType]
) -> None:
    server, runtime, grpc_server = encoder_modules
    sglang_launch_encoder, sglang_launch_dp_worker = server.launch_encoder, runtime.launch_dp_worker
    fresh_loader.setenv(BACKEND_ENV, "1")
    for _ in range(2):  # a second load (a process that loads plugins again) changes nothing
        fresh_loader.setattr(plugins, "_plugins_loaded", False)
        plugins.load_plugins()
        assert runtime.launch_encoder is grpc_server.launch_encoder is spawn_hook.launch_encoder
        assert runtime.launch_dp_worker is spawn_hook.launch_dp_worker
        assert server.launch_encoder is sglang_launch_encoder  # SGLang's own stays where it is defined
        assert (
            spawn_hook.original_of(spawn_hook.RUNTIME_MODULE, "launch_dp_worker") is sglang_launch_dp_worker
        )
        assert spawn_hook.original_of(spawn_hook.SERVER_MODULE, "launch_encoder") is sglang_launch_encoder
        assert len(mmkey_finders()) == 1
    # spawn pickles a target by reference: the child imports mmkey's function, not SGLang's
    for target in (runtime.launch_encoder, runtime.launch_dp_worker):
        data = pickle.dumps(target)
        assert b"mmkey.integrations.sglang._spawn" in data and b"sglang.srt" not in data
        assert pickle.loads(data) is target


def test_switch_off_leaves_sglangs_spawn_targets_alone(
    fresh_loader: pytest.MonkeyPatch, encoder_modules: tuple[ModuleType, ModuleType, ModuleType]
) -> None:
    server, runtime, grpc_server = encoder_modules
    for switch in ("", "0"):
        fresh_loader.setenv(BACKEND_ENV, switch)
        fresh_loader.setattr(plugins, "_plugins_loaded", False)
        plugins.load_plugins()
        assert runtime.launch_encoder is grpc_server.launch_encoder is server.launch_encoder
        assert runtime.launch_encoder.__module__ == spawn_hook.SERVER_MODULE
        assert runtime.launch_dp_worker.__module__ == spawn_hook.RUNTIME_MODULE
        assert mmkey_finders() == []


def test_a_missing_spawn_target_is_said_at_error_and_the_encoder_refuses_to_start(
    fresh_loader: pytest.MonkeyPatch,
    encoder_modules: tuple[ModuleType, ModuleType, ModuleType],
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, runtime, grpc_server = encoder_modules
    fresh_loader.delattr(runtime, "launch_dp_worker")  # as in an SGLang that renamed it
    fresh_loader.setattr(grpc_server, "launch_encoder", None)
    fresh_loader.setenv(BACKEND_ENV, "1")
    with caplog.at_level(logging.ERROR, logger=spawn_hook.__name__):
        plugins.load_plugins()
    assert f"{spawn_hook.RUNTIME_MODULE} has no function launch_dp_worker" in caplog.text
    assert f"{spawn_hook.GRPC_MODULE} has no function launch_encoder" in caplog.text
    assert runtime.launch_encoder is spawn_hook.launch_encoder  # the rest is still covered
    assert module_of("mooncake") == "mmkey.integrations.sglang"
    with pytest.raises(SGLangConfigError, match="has no function launch_dp_worker"):
        EmbeddingStoreFactory.create_backend("mooncake")


def test_an_sglang_that_loads_plugins_in_its_spawn_targets_is_not_patched(
    fresh_loader: pytest.MonkeyPatch, encoder_modules: tuple[ModuleType, ModuleType, ModuleType]
) -> None:
    _, runtime, _ = encoder_modules

    def launch_dp_worker(*args: object) -> None:  # what patches/sglang-0.5.23-load-plugins.patch makes
        plugins.load_plugins()

    fresh_loader.setattr(runtime, "launch_dp_worker", launch_dp_worker)
    fresh_loader.setenv(BACKEND_ENV, "1")
    plugins.load_plugins()
    assert runtime.launch_dp_worker is launch_dp_worker
    assert runtime.launch_encoder is spawn_hook.launch_encoder
    assert integration.plugin_errors() == []


def test_a_spawning_module_loaded_past_mmkeys_finder_is_detected(
    fresh_loader: pytest.MonkeyPatch, encoder_modules: tuple[ModuleType, ModuleType, ModuleType]
) -> None:
    _, runtime, _ = encoder_modules
    fresh_loader.setenv(BACKEND_ENV, "1")
    plugins.load_plugins()
    assert integration.plugin_errors() == []
    # what a finder ahead of mmkey's leaves behind: the module as SGLang wrote it
    fresh_loader.setattr(
        runtime, "launch_encoder", spawn_hook.original_of(spawn_hook.SERVER_MODULE, "launch_encoder")
    )
    with pytest.raises(SGLangConfigError, match="imported without mmkey's patch of launch_encoder"):
        EmbeddingStoreFactory.create_backend("mooncake")


def run_probe(labels: tuple[str, ...], env: dict[str, str], timeout: float = 400.0) -> dict[str, Any]:
    """`sglang_spawn_probe.py` in a process group of its own, killed whole if it overruns."""
    child = subprocess.Popen(
        [sys.executable, str(PROBE), *labels],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        pytest.fail(f"the spawn probe did not finish within {timeout} s")
    assert child.returncode == 0, err[-4000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def probe_env(switch: str, master: MasterProcess, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_PLUGINS", BACKEND_ENV)}
    env.update(
        {BACKEND_ENV: switch, "MMKEY_NAMESPACE": "spawned-model", "PYTHONPATH": os.pathsep.join(sys.path)}
    )
    env.update(
        MOONCAKE_MASTER=master.address, MOONCAKE_GLOBAL_SEGMENT_SIZE="16MB", MOONCAKE_LOCAL_BUFFER_SIZE="16MB"
    )
    env.update(MOONCAKE_PROTOCOL="tcp", **more)
    return env


def test_spawned_tp_ranks_and_dp_workers_build_mmkeys_store_or_refuse(
    mooncake_master_session: MasterProcess,
) -> None:
    # server.launch_encoder is SGLang's own entry point, spawned directly as without the plugin:
    # the control that shows the probe sees SGLang's store where mmkey's is not registered.
    # A gRPC TP rank and a DP worker are started without MMKEY_NAMESPACE: they refuse to start.
    built = ("runtime.launch_encoder", "runtime.launch_dp_worker")
    refused = ("no-namespace:grpc_server.launch_encoder", "no-namespace:runtime.launch_dp_worker")
    result = run_probe((*built, *refused, "server.launch_encoder"), probe_env("1", mooncake_master_session))
    assert result["targets"] == {
        "runtime.launch_encoder": f"{spawn_hook.__name__}.launch_encoder",
        "runtime.launch_dp_worker": f"{spawn_hook.__name__}.launch_dp_worker",
        refused[0]: f"{spawn_hook.__name__}.launch_encoder",
        refused[1]: f"{spawn_hook.__name__}.launch_dp_worker",
        "server.launch_encoder": f"{spawn_hook.SERVER_MODULE}.launch_encoder",
    }
    reports = {r["label"]: r for r in result["reports"]}
    assert sorted(reports) == sorted(result["targets"])
    for label in (*built, *refused):
        assert reports[label]["mooncake"] == "mmkey.integrations.sglang.MMKeyEmbeddingStore"
        assert reports[label]["args"] == 2  # SGLang's arguments reach its entry point unchanged
    for label in built:
        assert reports[label]["created"] == "mmkey.integrations.sglang._store.MMKeyEmbeddingStore"
        assert reports[label]["namespace"] == "spawned-model"
    for label in refused:
        assert "created" not in reports[label]
        assert "MMKEY_NAMESPACE is not set" in reports[label]["refused"]
    assert reports["server.launch_encoder"]["mooncake"] == f"{SGLANG_MOONCAKE}.MooncakeEmbeddingStore"
    # opted in, and mmkey's plugin never ran there: the guard of mmkey-sglang-guard.pth refuses
    assert "created" not in reports["server.launch_encoder"]
    assert "mmkey's SGLang plugin did not register" in reports["server.launch_encoder"]["refused"]
    assert result["exitcodes"] == [0] * 5


def test_a_launcher_whose_spawning_module_passed_a_finder_ahead_of_mmkeys_refuses_to_start(
    mooncake_master_session: MasterProcess,
) -> None:
    result = run_probe(("--finder-ahead",), probe_env("1", mooncake_master_session))
    assert "imported without mmkey's patch of launch_encoder" in result["launcher"]["refused"]
    assert "Bypass" in result["launcher"]["refused"]  # the finder ahead is named


ENTRY_SECRET = hashlib.sha256(b"mmkey sglang probe").hexdigest()
"""A fleet MAC secret (``MMKEY_ENTRY_KEY``, 64 hex digits): no refusal may echo it."""
MMKEY_STORE = "mmkey.integrations.sglang.MMKeyEmbeddingStore"


@pytest.fixture(scope="module")
def true_switch_probe(mooncake_master_session: MasterProcess) -> dict[str, Any]:
    """One launcher run with ``MMKEY_SGLANG_BACKEND=true``, a MAC secret set and no
    ``MMKEY_NAMESPACE``, the launcher told SGLang is 0.5.24 (``sglang.__version__`` set before
    its plugins load): its own backend, a TP rank given a namespace of its own and a DP worker."""
    env = probe_env("true", mooncake_master_session, MMKEY_ENTRY_KEY=ENTRY_SECRET)
    del env["MMKEY_NAMESPACE"]
    labels = ("namespace=true-model:runtime.launch_encoder", "runtime.launch_dp_worker")
    return run_probe(("--launcher", "--sglang-version=0.5.24", *labels), env)


def test_true_through_sglangs_loader_makes_mooncake_mmkeys_store_in_the_launcher_and_children(
    true_switch_probe: dict[str, Any],
) -> None:
    result = true_switch_probe
    assert result["targets"] == {
        "namespace=true-model:runtime.launch_encoder": f"{spawn_hook.__name__}.launch_encoder",
        "runtime.launch_dp_worker": f"{spawn_hook.__name__}.launch_dp_worker",
    }
    reports = {r["label"]: r for r in result["reports"]}
    for report in (result["launcher"], *reports.values()):
        assert report["mooncake"] == MMKEY_STORE
        assert f"{BACKEND_ENV}='true'" not in report.get("refused", "")  # "true" says on plainly
    tp_rank = reports["namespace=true-model:runtime.launch_encoder"]
    assert tp_rank["created"] == "mmkey.integrations.sglang._store.MMKeyEmbeddingStore"
    assert tp_rank["namespace"] == "true-model"
    assert result["exitcodes"] == [0, 0]


def test_a_missing_namespace_with_an_entry_secret_set_refuses_in_the_launcher_and_a_spawned_child(
    true_switch_probe: dict[str, Any],
) -> None:
    launcher = true_switch_probe["launcher"]
    [dp_worker] = [r for r in true_switch_probe["reports"] if r["label"] == "runtime.launch_dp_worker"]
    for report in (launcher, dp_worker):
        assert report["entry_key_set"]  # the secret was there: it does not stand in for a namespace
        assert "created" not in report
        assert "refuses to start" in report["refused"]
        assert "MMKEY_NAMESPACE is not set: name the model, revision and preprocessing" in report["refused"]
        assert ENTRY_SECRET not in report["refused"]


def test_an_sglang_version_outside_the_range_refuses_in_the_launcher_process(
    true_switch_probe: dict[str, Any],
) -> None:
    launcher = true_switch_probe["launcher"]
    assert "SGLang 0.5.24 is outside" in launcher["refused"]
    assert "install sglang==0.5.23" in launcher["refused"]
    # the children import the installed SGLang, 0.5.23: only their missing namespace is refused
    for report in true_switch_probe["reports"]:
        assert "is outside" not in report.get("refused", "")


def test_the_shipped_sglang_patch_applies_and_makes_the_spawn_targets_load_plugins(tmp_path: Path) -> None:
    import shutil
    import types

    import sglang

    patch_file = Path(__file__).parents[3] / "patches" / "sglang-0.5.23-load-plugins.patch"
    if shutil.which("patch") is None:
        pytest.skip("needs the patch program")
    site = Path(sglang.__file__).parents[1]
    files = {spawn_hook.SERVER_MODULE: "launch_encoder", spawn_hook.RUNTIME_MODULE: "launch_dp_worker"}
    for module in files:
        relative = Path(*module.split(".")).with_suffix(".py")
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(site / relative, tmp_path / relative)
    done = subprocess.run(
        ["patch", "-p1", "-d", str(tmp_path), "-i", str(patch_file)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for module, name in files.items():
        relative = Path(*module.split(".")).with_suffix(".py")
        code = compile((tmp_path / relative).read_text(), str(relative), "exec")
        function = next(c for c in code.co_consts if isinstance(c, types.CodeType) and c.co_name == name)
        assert spawn_hook.loads_plugins_itself(types.FunctionType(function, {}))
        original = getattr(importlib.import_module(module), name)
        assert not spawn_hook.loads_plugins_itself(
            spawn_hook.original_of(module, name) if original.__module__.startswith("mmkey") else original
        )


def test_the_switch_gives_caller_hashes_a_key_space_of_their_own(fresh_loader: pytest.MonkeyPatch) -> None:
    original = MMEncoder._prepare_encode_context
    fresh_loader.setenv(BACKEND_ENV, "1")
    plugins.load_plugins()
    assert integration.plugin_errors() == []
    assert caller_hashes.installed()
    applied = MMEncoder._prepare_encode_context
    assert applied is not original and getattr(applied, "__wrapped__", None) is original


def test_without_the_switch_caller_hashes_are_left_to_sglang(fresh_loader: pytest.MonkeyPatch) -> None:
    original = MMEncoder._prepare_encode_context
    plugins.load_plugins()
    assert not caller_hashes.installed()
    assert MMEncoder._prepare_encode_context is original


def test_the_switch_makes_the_caches_io_thread_wait_for_work(fresh_loader: pytest.MonkeyPatch) -> None:
    original = EmbeddingCacheController._io_loop
    fresh_loader.setenv(BACKEND_ENV, "1")
    plugins.load_plugins()
    assert io_loop.installed()
    applied = EmbeddingCacheController._io_loop
    assert applied is not original and getattr(applied, "__wrapped__", None) is original


def test_without_the_switch_or_with_errors_sglangs_io_loop_is_left(fresh_loader: pytest.MonkeyPatch) -> None:
    original = EmbeddingCacheController._io_loop
    plugins.load_plugins()
    assert EmbeddingCacheController._io_loop is original
    fresh_loader.setattr(plugins, "_plugins_loaded", False)
    fresh_loader.setenv(BACKEND_ENV, "1")
    fresh_loader.delenv("MMKEY_NAMESPACE")
    plugins.load_plugins()
    assert integration.plugin_errors() != [] and not io_loop.installed()
    assert EmbeddingCacheController._io_loop is original


# -- MMKEY_SGLANG_HASH=blake3: 128-bit feature hashes through SGLang's hook registry ----------


@pytest.fixture
def blake3_plugin(fresh_loader: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The plugin loaded with ``MMKEY_SGLANG_HASH=blake3``; SGLang's hook registry and the
    hooked functions restored afterwards."""
    import sglang.srt.managers.mm_utils as mm_utils

    import mmkey.integrations.sglang._hash as hashing

    fresh_loader.setattr(hashing, "_installed", False)
    fresh_loader.setattr(mm_utils, "tensor_hash", mm_utils.tensor_hash)
    fresh_loader.setattr(
        MMEncoder, "_calculate_hashes_from_features", MMEncoder._calculate_hashes_from_features
    )
    fresh_loader.setenv(BACKEND_ENV, "1")
    fresh_loader.setenv("MMKEY_SGLANG_HASH", "blake3")
    plugins.load_plugins()
    assert integration.plugin_errors() == []
    yield fresh_loader


def encoder_hashes(feature: Any, patches: list[int]) -> list[int]:
    """The encode server's own ``_calculate_hashes_from_features`` for a batch of images of
    `patches` rows each (its preprocessor stood in for: it only counts patches)."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.encoder.server import MMEncoder
    from sglang.srt.multimodal.modality import Modality as SGLangModality

    counts = iter(patches)
    # stands in for the `MMEncoder` the method is called on
    encoder: Any = SimpleNamespace(
        preprocessor=SimpleNamespace(get_num_patches=lambda grid, modality: next(counts))
    )
    hashes: list[int] = MMEncoder._calculate_hashes_from_features(
        encoder, feature, patches, SGLangModality.IMAGE
    )
    return hashes


def test_blake3_makes_sglangs_feature_hashes_128_bit(blake3_plugin: pytest.MonkeyPatch) -> None:
    import torch
    from sglang.srt.managers import mm_utils

    from mmkey import HashScheme, hash_tensor

    features = [torch.randn(16, 8, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    hashed = [mm_utils.hash_feature(f) for f in features]  # how SGLang hashes an item's feature
    assert hashed == [int(hash_tensor(f, HashScheme.BLAKE3)) for f in features]
    assert max(hashed) >= 2**64  # 128 bits wide (8 draws below 2**64 by chance: 2**-512)
    # the encoder's hashes keep all 128 bits, although SGLang's item keeps only 64 of them
    batch = torch.cat(features[:3])
    assert encoder_hashes(batch, [16, 16, 16]) == hashed[:3]


def test_the_blake3_hash_of_several_tensors_is_pinned() -> None:
    """Several tensors hash to BLAKE3-128 of their 16-byte big-endian digests in order; the
    value is pinned, so a change of that layout (which would re-key every stored entry of a
    multi-tensor item) fails here."""
    import torch

    from mmkey import HashScheme, hash_bytes, hash_tensor
    from mmkey.integrations.sglang._hash import feature_hash

    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.ones(2, 4, dtype=torch.float32)
    digests = b"".join(int(hash_tensor(t, HashScheme.BLAKE3)).to_bytes(16, "big") for t in (a, b))
    assert feature_hash([a, b]) == int(hash_bytes(digests, HashScheme.BLAKE3))
    assert feature_hash([a, b]) == 0xE9F2E73238A51EAC1AD39894A64D7AF1
    assert feature_hash([[a], (b,)]) == feature_hash([a, b])  # nesting is flattened
    assert feature_hash([b, a]) == 0x95BA1F9A95811AAAE8F92FDD9A65FA1C  # the order counts


def test_without_the_switch_sglang_keeps_its_64_bit_hash(fresh_loader: pytest.MonkeyPatch) -> None:
    import torch

    from mmkey import HashScheme, hash_tensor

    fresh_loader.setenv(BACKEND_ENV, "1")
    plugins.load_plugins()
    feature = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    [value] = encoder_hashes(feature, [6])
    assert value == int(hash_tensor(feature, HashScheme.SGLANG))  # SGLang's SHA-256, 64 bits


def test_features_that_collide_under_sglangs_64_bit_hash_get_different_keys(
    blake3_plugin: pytest.MonkeyPatch,
) -> None:
    import torch

    from mmkey import HashScheme, Modality, hash_tensor
    from mmkey.integrations.sglang._keys import sglang_key

    pixels = torch.randn(24, 16, generator=torch.Generator().manual_seed(5))
    # the same bytes as 24 patches of 16 and as 16 patches of 24 (another image size), or
    # read as int32: SGLang's hash sees only the bytes, so all three collide in all 64 bits
    a, b, c = pixels, pixels.reshape(16, 24), pixels.view(torch.int32)
    assert len({int(hash_tensor(t, HashScheme.SGLANG)) for t in (a, b, c)}) == 1
    hashes = [encoder_hashes(t, [t.shape[0]])[0] for t in (a, b, c)]
    keys = {sglang_key("m", Modality.IMAGE, str(h), HashScheme.BLAKE3).to_key() for h in hashes}
    assert len(keys) == 3
    assert all("@blake3@" in key for key in keys)


def test_blake3_without_the_plugin_refuses_to_start(fresh_loader: pytest.MonkeyPatch) -> None:
    import mmkey.integrations.sglang._hash as hashing

    fresh_loader.setattr(hashing, "_installed", False)
    fresh_loader.setenv("MMKEY_SGLANG_HASH", "blake3")
    EmbeddingStoreFactory.register_backend("mmkey", "mmkey.integrations.sglang", "MMKeyEmbeddingStore")
    with pytest.raises(SGLangConfigError, match="set MMKEY_SGLANG_BACKEND=1 instead"):
        EmbeddingStoreFactory.create_backend("mmkey")


def test_the_blake3_hash_hooks_are_installed_only_by_install_and_once() -> None:
    code = (
        "from mmkey.integrations.sglang import _hash\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "before = _hash.installed()\n"
        "_hash.install()\n"
        "_hash.install()\n"
        "print(before, _hash.installed(), len(HookRegistry._hooks[_hash.TENSOR_HASH]))\n"
    )
    command = [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "1"], "one hook however many installs"
