"""`import mmkey` stays cheap: no torch, no mooncake, no hypothesis until needed."""

from __future__ import annotations

import subprocess
import sys

import mmkey


def imported_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_import_mmkey_loads_neither_torch_nor_mooncake() -> None:
    loaded = imported_after("import mmkey")
    heavy = {"torch", "mooncake", "mooncake.store", "hypothesis", "numpy", "blake3", "xxhash"}
    assert not loaded & heavy, loaded & heavy
    assert "mmkey" in loaded  # the control: the import did happen


def test_keys_work_without_loading_torch() -> None:
    loaded = imported_after(
        "import mmkey\n"
        "k = mmkey.EmbeddingKey('m', mmkey.Modality.IMAGE, mmkey.HashScheme.XXH3, mmkey.mm_hash(1))\n"
        "assert mmkey.EmbeddingKey.from_key(k.to_key()) == k"
    )
    assert "torch" not in loaded


def test_public_names_are_exported() -> None:
    for name in mmkey.__all__:
        assert getattr(mmkey, name) is not None
    for required in (
        "MMHash",
        "mm_hash",
        "HashScheme",
        "Modality",
        "hash_tensor",
        "hash_bytes",
        "CacheKey",
        "EmbeddingKey",
        "EmbeddingCache",
        "InvalidKey",
        "InvalidDigest",
    ):
        assert required in mmkey.__all__


def test_hash_bytes_does_not_load_torch() -> None:
    loaded = imported_after(
        "import mmkey\nassert mmkey.hash_bytes(b'x') == mmkey.hash_bytes(bytearray(b'x'))"
    )
    assert "torch" not in loaded and "xxhash" not in loaded


def test_import_mmkey_leaves_the_mooncake_client_unloaded_until_named() -> None:
    loaded = imported_after("import mmkey")
    assert not {"mmkey.cache.mooncake._cache", "mmkey.cache.mooncake._transport"} & loaded
    named = imported_after("import mmkey\nmmkey.MooncakeCache")
    assert "mmkey.cache.mooncake._cache" in named  # the control: naming it loads it


def test_the_mooncake_package_loads_its_client_only_when_named() -> None:
    loaded = imported_after("import mmkey.cache.mooncake")
    assert not {"mmkey.cache.mooncake._cache", "mmkey.cache.mooncake._transport"} & loaded
    named = imported_after("from mmkey.cache.mooncake import MooncakeCache")
    assert "mmkey.cache.mooncake._cache" in named  # the control


def test_the_library_never_imports_the_cli_extra() -> None:
    loaded = imported_after(
        "import mmkey, mmkey.cache.mooncake, mmkey.cache.tiered, mmkey.cache.aio, mmkey.metrics\n"
        "mmkey.MooncakeCache"
    )
    assert not {"click", "rich"} & loaded, {"click", "rich"} & loaded
    assert "click" in imported_after("import mmkey.cli._group")  # the control


def test_unknown_names_are_attribute_errors() -> None:
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        _ = mmkey.NoSuchName  # type: ignore[attr-defined]
