"""MooncakeConfig's documented details the other config tests leave open: every size unit, the
defaults of mmkey's own fields, one-character names, keyword-only slotted records, and the
errors of `parse_size` and `read_json_config`."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmkey.cache.mooncake.config import Env, MooncakeConfig, parse_size, read_json_config

ADDRESS = "127.0.0.1:50051"


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("7", 7),
        ("7b", 7),
        ("7B", 7),
        ("3k", 3 << 10),
        ("3kb", 3 << 10),
        ("3m", 3 << 20),
        ("3g", 3 << 30),
        ("3gb", 3 << 30),
        ("3t", 3 << 40),
        ("3TB", 3 << 40),
    ],
)
def test_every_unit_is_a_power_of_1024(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("value", [True, 1.5, None, b"1k"])
def test_parse_size_takes_only_an_int_or_text(value: object) -> None:
    with pytest.raises(TypeError, match="512MB"):
        parse_size(value)  # type: ignore[arg-type]


def test_the_defaults_of_copies_trust_and_the_largest_entry() -> None:
    config = MooncakeConfig(master_server_address=ADDRESS)
    assert config.replica_num == 1
    assert config.trusted_network is False
    assert config.max_entry_size == 64 << 20  # docs/security.md: 64 MiB by default


def test_one_character_names_are_accepted() -> None:
    config = MooncakeConfig(
        master_server_address=ADDRESS, local_hostname="h", metadata_server="m", tenant_id="t"
    )
    assert (config.local_hostname, config.metadata_server, config.tenant_id) == ("h", "m", "t")


def test_the_config_is_a_keyword_only_slotted_record() -> None:
    with pytest.raises(TypeError):
        MooncakeConfig(ADDRESS)  # type: ignore[call-arg]
    assert not hasattr(MooncakeConfig(master_server_address=ADDRESS), "__dict__")
    assert not hasattr(Env("MOONCAKE_MASTER"), "__dict__")


def test_a_config_file_that_is_not_an_object_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text('["127.0.0.1:50051"]')
    with pytest.raises(ValueError, match="expected a JSON object"):
        read_json_config(str(path))
    with pytest.raises(ValueError, match="MOONCAKE_CONFIG_PATH"):
        MooncakeConfig.from_env({"MOONCAKE_CONFIG_PATH": str(path)})
