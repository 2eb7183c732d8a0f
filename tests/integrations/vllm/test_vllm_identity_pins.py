"""A local checkpoint's identity and a vLLM setup's namespace (no vLLM needed but for the
metadata at the end): a truncated weights file refused, every file's digest remembered, the
order of a config's fields not part of what a setup is, vLLM's defaults where a config leaves
LoRA or prefix caching out, and the connector's plan and counters as vLLM sees them."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

import pytest

from mmkey.integrations.vllm._identity import checkpoint_identity, weights_digest
from mmkey.integrations.vllm._namespace import check_identifiers, namespace_from_vllm_config
from tests.integrations.vllm.checkpoints import counted_file_reads, write_weights
from tests.integrations.vllm.vllm_support import require_vllm

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@pytest.fixture(autouse=True)
def weights_memo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def test_a_weights_file_shorter_than_its_header_is_refused(tmp_path: Path) -> None:
    """A truncated download is an error naming the file, never a digest of what is there."""
    path = write_weights(tmp_path / "m" / "model.safetensors", {"visual.w": b"\x05" * 32}, cut=4)
    with pytest.raises(ValueError, match="shorter than its safetensors header says"):
        weights_digest(path)


def test_a_one_byte_vision_tensor_is_part_of_the_digest(tmp_path: Path) -> None:
    """Every byte of the vision side counts, down to a tensor of one byte (an int8 scalar)."""
    digests = {
        weights_digest(
            write_weights(tmp_path / str(value) / "model.safetensors", {"visual.scale": bytes([value])})
        )
        for value in (1, 2)
    }
    assert len(digests) == 2


def test_the_digest_of_every_file_is_remembered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second file's digest joins the first's in the memo: a restart reads neither again."""
    first = write_weights(tmp_path / "m" / "a.safetensors", {"visual.w": b"\x05" * 32})
    second = write_weights(tmp_path / "m" / "b.safetensors", {"visual.w": b"\x06" * 32})
    digests = [weights_digest(first), weights_digest(second)]
    reads = counted_file_reads(monkeypatch)
    assert [weights_digest(first), weights_digest(second)] == digests and reads == []


def test_the_order_of_a_configs_fields_is_not_part_of_the_identity(tmp_path: Path) -> None:
    """The same config.json written with its fields in another order is the same checkpoint."""
    config = {
        "architectures": ["LlavaForConditionalGeneration"],
        "hidden": 8,
        "vision": {"depth": 2, "width": 4},
    }
    reordered = {
        "vision": {"width": 4, "depth": 2},
        "hidden": 8,
        "architectures": ["LlavaForConditionalGeneration"],
    }
    identities = []
    for name, fields in (("a", config), ("b", reordered)):
        root = tmp_path / name
        write_weights(root / "model.safetensors", {"visual.w": b"\x05" * 32})
        (root / "config.json").write_text(json.dumps(fields))
        identities.append(checkpoint_identity(root))
    assert identities[0] is not None and identities[0] == identities[1]


def setup(
    model: str = "org/vl-model", *, mm: object = None, hf_overrides: object = None, **more: object
) -> VllmConfig:
    """A stand-in `VllmConfig`: a model config, and `more` beside it (cache_config, lora_config)."""
    model_config = SimpleNamespace(
        model=model, revision=None, dtype="bfloat16", multimodal_config=mm, hf_overrides=hf_overrides
    )
    return cast("VllmConfig", SimpleNamespace(model_config=model_config, **more))


def multimodal(**kwargs: object) -> SimpleNamespace:
    """A stand-in `MultiModalConfig` with these processor kwargs."""
    return SimpleNamespace(
        compute_hash=lambda: "encoder-hash", mm_processor_kwargs=kwargs, mm_processor_cache_gb=0
    )


def test_the_order_of_processor_kwargs_and_overrides_is_not_part_of_the_namespace() -> None:
    """The same settings given in another order (a JSON flag typed differently) share entries."""
    one = setup(mm=multimodal(min_pixels=1, max_pixels=2))
    two = setup(mm=multimodal(max_pixels=2, min_pixels=1))
    assert namespace_from_vllm_config(one) == namespace_from_vllm_config(two)
    overrides = [
        {"vision_config": {"image_size": 448, "patch": 14}},
        {"vision_config": {"patch": 14, "image_size": 448}},
    ]
    assert len({namespace_from_vllm_config(setup(hf_overrides=fields)) for fields in overrides}) == 1


def test_a_local_checkpoints_namespace_names_its_architecture_and_64_bits_of_its_identity(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    write_weights(root / "model.safetensors", {"visual.w": b"\x05" * 32})
    (root / "config.json").write_text(json.dumps({"architectures": ["LlavaForConditionalGeneration"]}))
    identity = checkpoint_identity(root)
    assert identity is not None
    namespace = namespace_from_vllm_config(setup(str(root)))
    assert namespace.startswith(f"vllm/LlavaForConditionalGeneration@blake3-{identity[:16]}/bfloat16#")


def test_a_config_without_cache_or_lora_settings_takes_vllms_defaults() -> None:
    """Prefix caching on and no tower LoRA where the config says nothing; LoRA on the tower
    without a namespace of its own is refused."""
    counters = multimodal()  # the processor cache off: only prefix caching keeps identifiers content
    check_identifiers(setup(mm=counters), explicit_namespace=False)
    check_identifiers(setup(mm=counters, lora_config=None, cache_config=None), explicit_namespace=False)
    off = SimpleNamespace(enable_prefix_caching=False)
    with pytest.raises(ValueError, match="prefix caching off"):
        check_identifiers(setup(mm=counters, cache_config=off), explicit_namespace=False)
    tower = SimpleNamespace(enable_tower_connector_lora=True)
    with pytest.raises(ValueError, match="enable_tower_connector_lora"):
        check_identifiers(setup(mm=counters, lora_config=tower), explicit_namespace=False)


def test_a_plan_that_crossed_processes_equals_the_plan_sent() -> None:
    """A worker's copy of the scheduler's plan compares equal to it (never by tensor values)."""
    require_vllm()
    import torch

    from mmkey.integrations.vllm._metadata import LoadItem, MMKeyECMetadata

    plan = MMKeyECMetadata(loads=(LoadItem("img-1", torch.arange(8.0)),))
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_the_hit_rate_is_reported_only_with_lookups_and_counts_only_what_was_found() -> None:
    require_vllm()
    from mmkey.integrations.vllm._metadata import MMKeyECStats

    assert MMKeyECStats(data={"saves": 2, "saved": 0}).reduce() == {"saves": 2}  # what moved
    assert MMKeyECStats(data={"lookups": 4}).reduce() == {"lookups": 4, "hit_rate": 0.0}
