"""The SGLang plugin: SGLang's own loader finds mmkey's entry point; only the switch changes anything.

Runs in SGLang's environment with mmkey installed (its entry point registered); skips
elsewhere unless MMKEY_REQUIRE_SGLANG=1.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from sglang_support import require_sglang

require_sglang()

import sglang.srt.plugins as plugins  # noqa: E402
from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory  # noqa: E402

from mmkey.integrations.sglang import BACKEND_ENV, MMKeyEmbeddingStore  # noqa: E402
from mmkey.testing.mooncake_master import MasterProcess  # noqa: E402

SGLANG_MOONCAKE = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_embedding_store"


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """SGLang's plugin loader and backend registry as in a new process, restored afterwards."""
    monkeypatch.setattr(EmbeddingStoreFactory, "_registry", dict(EmbeddingStoreFactory._registry))
    monkeypatch.setattr(plugins, "_plugins_loaded", False)
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setenv("MMKEY_NAMESPACE", "plugin-model")
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


@pytest.mark.parametrize(("switch", "namespace", "message"), [("yes", "m", BACKEND_ENV), ("1", "", "MMKEY_NAMESPACE")])
def test_a_bad_switch_or_missing_namespace_is_logged_and_sglang_keeps_its_backend(
    fresh_loader: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, switch: str, namespace: str, message: str
) -> None:
    fresh_loader.setenv(BACKEND_ENV, switch)
    fresh_loader.setenv("MMKEY_NAMESPACE", namespace)
    with caplog.at_level(logging.ERROR):
        plugins.load_plugins()
    assert module_of("mooncake") == SGLANG_MOONCAKE
    assert "Failed to execute general plugin: mmkey" in caplog.text
    assert message in caplog.text
