"""Keys, namespaces and extra-config parsing of the vLLM connector (no vLLM needed)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mmkey import EmbeddingKey, HashScheme, InvalidKey, Modality, identifier_digest
from mmkey.integrations.vllm._connector_settings import (
    EXTRA_CONFIG_KEYS,
    ConnectorSettings,
    StoreKind,
    check_identifiers_are_content_hashes,
    content_digest,
    identifier_key,
    identifier_keys,
    modality_of,
    scoped_identifier_key,
    vllm_namespace,
)
from mmkey.keys import MAX_NAMESPACE_CHARS
from mmkey.testing.strategies import modalities, namespaces
from tests.integrations.vllm.checkpoints import counted_file_reads, write_checkpoint

identifiers = st.text(min_size=1)  # hypothesis leaves out lone surrogates by default
hex_ids = st.binary(min_size=32, max_size=32).map(bytes.hex)


@given(namespaces(), modalities(), identifiers, identifiers)
@example("m", Modality.IMAGE, "abc", "ABC")  # case is never folded
@example("m", Modality.IMAGE, "0abc", "abc")  # nor are leading zeros of hex text
@example("m", Modality.IMAGE, "a b", "a%20b")  # nor is text percent-decoded
@example("m", Modality.IMAGE, "\u00e9", "e\u0301")  # nor Unicode-normalised
def test_distinct_identifiers_never_share_a_key(
    namespace: str, modality: Modality, first: str, second: str
) -> None:
    a = identifier_key(namespace, modality, first)
    b = identifier_key(namespace, modality, second)
    assert (a.to_key() == b.to_key()) == (first == second)
    assert EmbeddingKey.from_key(a.to_key()) == a


@given(namespaces(), modalities(), st.one_of(hex_ids, st.uuids().map(str)))
def test_keys_of_vllm_identifiers_are_id_digests_of_the_text(
    namespace: str, modality: Modality, identifier: str
) -> None:
    key = identifier_key(namespace, modality, identifier)
    assert (key.namespace, key.modality, key.scheme) == (namespace, modality, HashScheme.ID)
    assert key.digest == identifier_digest(identifier)
    assert key.to_key().endswith(f"@id@{key.digest:032x}")


@given(namespaces(), modalities(), st.lists(identifiers, max_size=8))
def test_keys_built_together_are_the_same_keys(namespace: str, modality: Modality, ids: list[str]) -> None:
    together = identifier_keys(namespace, modality, ids)
    assert together == [identifier_key(namespace, modality, i) for i in ids]
    assert [k.to_key() for k in together] == [identifier_key(namespace, modality, i).to_key() for i in ids]


def test_identifier_text_is_checked() -> None:
    with pytest.raises(InvalidKey):
        identifier_key("m", Modality.IMAGE, "")
    with pytest.raises(TypeError):
        identifier_key("m", Modality.IMAGE, b"abc")  # type: ignore[arg-type]


def test_vllm_modality_names() -> None:
    assert [modality_of(n) for n in ("image", "video", "audio")] == list(Modality)
    assert modality_of("prompt_embeds") is None and modality_of("IMAGE") is None


parts = st.tuples(
    st.text(min_size=1, max_size=400),
    st.one_of(st.none(), st.text(max_size=40)),
    st.text(max_size=64),
    st.sampled_from(["torch.bfloat16", "torch.float16", "float32"]),
)


@given(parts, parts)
@example(
    ("Qwen/Qwen2-VL-7B", "main", "enc1", "torch.bfloat16"),
    ("Qwen/Qwen2-VL-7B", "main", "enc2", "torch.bfloat16"),
)
@example(
    ("Qwen/Qwen2-VL-7B", None, "e", "torch.bfloat16"), ("Qwen/Qwen2-VL-7B", "default", "e", "torch.bfloat16")
)
@example(("x" * 300 + "a", "r", "e", "float32"), ("x" * 300 + "b", "r", "e", "float32"))
def test_namespaces_are_valid_and_differ_with_any_part(
    first: tuple[str, str | None, str, str], second: tuple[str, str | None, str, str]
) -> None:
    try:
        a = vllm_namespace(*first)
    except InvalidKey:
        return
    assert len(a) <= MAX_NAMESPACE_CHARS
    EmbeddingKey(a, Modality.IMAGE, HashScheme.ID, identifier_digest("x"))  # a valid namespace
    same = (first[0], first[1] or "default", first[2], first[3].removeprefix("torch."))
    other = (second[0], second[1] or "default", second[2], second[3].removeprefix("torch."))
    if same != other:
        with contextlib.suppress(InvalidKey):
            assert vllm_namespace(*second) != a


def test_namespace_reads_well() -> None:
    ns = vllm_namespace("Qwen/Qwen2-VL-7B-Instruct", None, "abc", "torch.bfloat16")
    assert ns.startswith("vllm/Qwen/Qwen2-VL-7B-Instruct@default/bfloat16#")
    assert vllm_namespace("Qwen/Qwen2-VL-7B-Instruct", None, "abc", "bfloat16") == ns


def test_namespace_never_changes() -> None:
    """A namespace is part of every key: a changed tag would orphan every stored entry."""
    ns = vllm_namespace("Qwen/Qwen2-VL-7B-Instruct", None, "abc", "torch.bfloat16")
    assert ns == "vllm/Qwen/Qwen2-VL-7B-Instruct@default/bfloat16#f3bf12da3fab05b6"
    long = vllm_namespace("x" * 300, "r", "e", "float32")
    assert len(long) == MAX_NAMESPACE_CHARS and long.endswith("x@r/float32#" + long[-16:])


def test_extra_config_defaults_and_values() -> None:
    assert ConnectorSettings.from_extra_config(None) == ConnectorSettings()
    settings = ConnectorSettings.from_extra_config(
        {
            "namespace": "qwen@r1",
            "store": "memory",
            "memory_max_bytes": "64MB",
            "max_pending_save_bytes": 1024,
            "mooncake": {"timeout": 0.25},
        }
    )
    assert settings.namespace == "qwen@r1" and settings.store is StoreKind.MEMORY
    assert settings.memory_max_bytes == 64 << 20 and settings.max_pending_save_bytes == 1024
    assert settings.mooncake == {"timeout": 0.25}
    assert ConnectorSettings.from_extra_config({"producer_wait_s": 0}).producer_wait_s == 0.0
    assert type(ConnectorSettings.from_extra_config({"producer_wait_s": 5}).producer_wait_s) is float
    assert "namespace" in EXTRA_CONFIG_KEYS


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ({"namespce": "x"}, ValueError, "unknown keys"),
        ({"namespace": 7}, TypeError, r"ec_connector_extra_config\['namespace'\] must be text"),
        ({"namespace": ""}, InvalidKey, "namespace"),
        ({"namespace": "x" * 257}, InvalidKey, "namespace"),
        ({"store": "redis"}, ValueError, "mooncake"),
        ({"mooncake": "10.0.0.5:50051"}, TypeError, "master_server_address"),
        ({"mooncake": {"master": "h:1"}}, ValueError, "unknown fields"),
        ({"memory_max_bytes": 0}, ValueError, "> 0"),
        ({"max_pending_save_bytes": "lots"}, ValueError, "size"),
        ({"max_pending_save_bytes": 1.5}, TypeError, "size text"),
        ({"store": 5}, ValueError, r"\['store'\] must be one of"),
        ({"producer_wait_s": True}, TypeError, "seconds"),
        ({"producer_wait_s": "2"}, TypeError, "seconds"),
        ({"producer_wait_s": 61}, ValueError, "0-60"),
        ({"producer_wait_s": -0.5}, ValueError, "0-60"),
    ],
)
def test_bad_extra_config_is_refused_naming_the_fix(
    extra: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        ConnectorSettings.from_extra_config(extra)


def test_defaults_are_the_documented_ones() -> None:
    """The defaults docs/vllm.md's table lists."""
    settings = ConnectorSettings()
    assert (settings.namespace, settings.store, settings.mooncake) == (None, StoreKind.MOONCAKE, {})
    assert settings.memory_max_bytes == settings.max_staged_bytes == 1 << 30
    assert settings.max_pending_save_bytes == 512 << 20
    assert (settings.producer_wait_s, settings.first_answer_wait_s, settings.save_hold_s) == (
        2.0,
        0.003,
        0.05,
    )


def test_extra_config_that_is_not_a_dict_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="ec_connector_extra_config must be a dict"):
        ConnectorSettings.from_extra_config(["namespace"])  # type: ignore[arg-type]


def test_settings_are_keyword_only_and_slotted() -> None:
    with pytest.raises(TypeError):
        ConnectorSettings("qwen@r1")  # type: ignore[call-arg]
    assert not hasattr(ConnectorSettings(), "__dict__")


def test_mooncake_config_from_env_then_extra_config(tmp_path: Path) -> None:
    env = {"MOONCAKE_MASTER": "127.0.0.1:50051", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1GB"}
    settings = ConnectorSettings.from_extra_config(
        {"mooncake": {"timeout": 0.3, "local_buffer_size": "64MB"}}
    )
    worker = settings.mooncake_config(pure_client=False, environ=env)
    assert worker.master_server_address == "127.0.0.1:50051"
    assert worker.global_segment_size == 1 << 30 and worker.local_buffer_size == 64 << 20
    assert worker.timeout == 0.3
    assert settings.mooncake_config(pure_client=True, environ=env).global_segment_size == 0
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.1:6000"}))
    assert (
        settings.mooncake_config(
            pure_client=False, environ={"MOONCAKE_CONFIG_PATH": str(path)}
        ).master_server_address
        == "127.0.0.1:6000"
    )
    explicit = ConnectorSettings.from_extra_config({"mooncake": {"master_server_address": "127.0.0.1:7000"}})
    assert explicit.mooncake_config(pure_client=False, environ=env).master_server_address == "127.0.0.1:7000"
    with pytest.raises(ValueError, match="MOONCAKE_MASTER.*store"):
        ConnectorSettings().mooncake_config(pure_client=False, environ={})


def test_counter_identifiers_and_tower_lora_are_refused_naming_the_settings() -> None:
    with pytest.raises(ValueError, match="mm_processor_cache_gb > 0.*enable-prefix-caching"):
        check_identifiers_are_content_hashes(
            processor_cache_gb=0, prefix_caching=False, tower_lora=False, explicit_namespace=False
        )
    with pytest.raises(ValueError, match="enable_tower_connector_lora.*namespace"):
        check_identifiers_are_content_hashes(
            processor_cache_gb=4, prefix_caching=True, tower_lora=True, explicit_namespace=False
        )
    for cache_gb, prefix in [(4, False), (1, False), (0.25, False), (0, True), (4, True)]:
        check_identifiers_are_content_hashes(
            processor_cache_gb=cache_gb, prefix_caching=prefix, tower_lora=False, explicit_namespace=False
        )
    check_identifiers_are_content_hashes(
        processor_cache_gb=4, prefix_caching=True, tower_lora=True, explicit_namespace=True
    )


def test_content_digests_never_change() -> None:
    """A content digest is the digest of every key of an item vLLM sent with its data: a
    changed value would orphan every stored entry."""
    import torch

    pixels = torch.arange(48, dtype=torch.float32).reshape(3, 4, 4)
    digest = content_digest({"pixel_values": pixels, "grid": [torch.tensor([1, 2, 3])]})
    assert digest == 0x5EDF64FE0F1A052F49D839E0F07C17A


def test_scoped_identifier_keys_never_change() -> None:
    """The key of an item sent without its data, within a tenant or adapter, is stored too."""
    salted = scoped_identifier_key("ns", Modality.IMAGE, "img-1", cache_salt="tenant-a", lora=None)
    adapted = scoped_identifier_key("ns", Modality.IMAGE, "img-1", cache_salt=None, lora="ad")
    assert salted.to_key() == "mmk1@ns@image@id@90d8043d93c75d4bac654b248bde2bb1"
    assert adapted.to_key() == "mmk1@ns@image@id@f28b02b00b7c29e4779c2bc5324ba483"


def test_content_digests_cover_field_names_dtypes_shapes_and_bytes() -> None:
    import torch

    pixels = torch.arange(48, dtype=torch.float32).reshape(3, 4, 4)
    base = content_digest({"pixel_values": pixels})
    assert base is not None
    assert base == content_digest({"pixel_values": pixels.clone()})
    assert base == content_digest({"pixel_values": pixels.transpose(1, 2).contiguous().transpose(1, 2)})
    changed = pixels.clone()
    changed[0, 0, 0] += 1
    others = [
        content_digest({"pixel_values": changed}),
        content_digest({"pixel_values": pixels.to(torch.float64)}),
        content_digest({"pixel_values": pixels.reshape(3, 16)}),
        content_digest({"pixel_value": pixels}),
        content_digest({"pixel_values": pixels, "image_grid_thw": torch.tensor([1, 2, 2])}),
        content_digest({"pixel_values": [pixels]}),
    ]
    assert len({base, *others}) == len(others) + 1
    # a field vLLM left out (None) or anything not a tensor: no digest, the identifier is used
    assert content_digest({"pixel_values": None}) is None
    assert content_digest({"pixel_values": [pixels, "text"]}) is None
    assert content_digest({}) is None


def test_a_checkpoint_is_named_by_what_it_is_not_where_it_lies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mmkey.integrations.vllm._identity import checkpoint_identity

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    weights = {"vision_tower.patch.weight": b"\x01" * 64, "language_model.embed.weight": b"\x02" * 64}
    here = checkpoint_identity(write_checkpoint(tmp_path / "a" / "llava", weights))
    assert here is not None
    # the same checkpoint at another path (its config even names the other path)
    assert checkpoint_identity(write_checkpoint(tmp_path / "elsewhere" / "copy", weights)) == here
    # the language model is not the vision side: fine-tuning it keeps the entries
    lm_tuned = dict(weights, **{"language_model.embed.weight": b"\x03" * 64})
    assert checkpoint_identity(write_checkpoint(tmp_path / "lm", lm_tuned)) == here
    others = [
        checkpoint_identity(
            write_checkpoint(
                tmp_path / "v", dict(weights, **{"vision_tower.patch.weight": b"\x01" * 63 + b"\x00"})
            )
        ),
        checkpoint_identity(write_checkpoint(tmp_path / "p", weights, preprocessor={"size": 448})),
        checkpoint_identity(
            write_checkpoint(
                tmp_path / "c",
                weights,
                config={"architectures": ["LlavaForConditionalGeneration"], "hidden": 16},
            )
        ),
    ]
    assert None not in others and len({here, *others}) == 4
    assert checkpoint_identity(tmp_path / "no-such-dir") is None  # a hub name: the caller decides
    assert (tmp_path / "cache" / "mmkey" / "vllm-weights.json").is_file()  # remembered


def test_remembered_weight_digests_follow_the_files_size_and_mtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from mmkey.integrations.vllm._identity import weights_digest

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root = write_checkpoint(tmp_path / "m", {"visual.w": b"\x05" * 32})
    path = root / "model.safetensors"
    first = weights_digest(path)
    reads = counted_file_reads(monkeypatch)
    assert weights_digest(path) == first and reads == []  # remembered: not read again
    write_checkpoint(root, {"visual.w": b"\x06" * 32})
    os.utime(path, ns=(1, 1))
    assert weights_digest(path) != first and reads == [path]  # changed: read again
