"""MooncakeConfig: Mooncake's field names, its environment variables, clear errors."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import attrs
import pytest

import mmkey.cache.mooncake.config as mooncake_config
from mmkey.cache.mooncake.config import MooncakeConfig, parse_size
from mmkey.testing.pytest_plugin import REQUIRE_ENV

if TYPE_CHECKING:
    from mmkey.testing.mooncake_master import MasterProcess


def test_defaults_use_mooncake_names_and_a_p2p_handshake() -> None:
    config = MooncakeConfig(master_server_address="127.0.0.1:50051")
    assert config.metadata_server == "P2PHANDSHAKE"
    assert config.protocol == "tcp"
    assert config.timeout < 2.0
    assert config.setup_args() == (
        "127.0.0.1",
        "P2PHANDSHAKE",
        512 << 20,
        128 << 20,
        "tcp",
        "",
        "127.0.0.1:50051",
    )


def test_config_is_frozen() -> None:
    config = MooncakeConfig(master_server_address="127.0.0.1:50051")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        config.timeout = 3.0  # type: ignore[misc]


def test_from_env_reads_mooncakes_variables() -> None:
    env = {
        "MOONCAKE_MASTER": "10.0.0.5:50051",
        "MOONCAKE_PROTOCOL": "rdma",
        "MOONCAKE_DEVICE": "mlx5_0",
        "MOONCAKE_TE_META_DATA_SERVER": "http://meta:8080/metadata",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1gb",
        "MOONCAKE_LOCAL_BUFFER_SIZE": "268435456",
        "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.7",
    }
    config = MooncakeConfig.from_env(env, timeout=0.25)
    assert config == MooncakeConfig(
        master_server_address="10.0.0.5:50051",
        protocol="rdma",
        device_name="mlx5_0",
        metadata_server="http://meta:8080/metadata",
        global_segment_size=1 << 30,
        local_buffer_size=256 << 20,
        local_hostname="10.0.0.7",
        timeout=0.25,
    )


def test_from_env_reads_a_config_file_and_lets_variables_win(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps(
            {
                "master_server_address": "127.0.0.1:7000",
                "local_buffer_size": "64MB",
                "protocol": "tcp",
                "unknown_field": 1,
            }
        )
    )
    config = MooncakeConfig.from_env({"MOONCAKE_CONFIG_PATH": str(path), "MOONCAKE_PROTOCOL": "rdma"})
    assert config.master_server_address == "127.0.0.1:7000"
    assert config.local_buffer_size == 64 << 20
    assert config.protocol == "rdma"


def test_from_env_without_a_master_says_what_to_set() -> None:
    with pytest.raises(ValueError, match="MOONCAKE_MASTER"):
        MooncakeConfig.from_env({})


def test_from_env_with_an_unreadable_file_names_it(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="MOONCAKE_CONFIG_PATH"):
        MooncakeConfig.from_env({"MOONCAKE_CONFIG_PATH": str(bad)})


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512MB", 512 << 20),
        ("1g", 1 << 30),
        ("3355443200", 3355443200),
        (" 2 KB ", 2048),
        ("1.5m", 3 << 19),
        (7, 7),
    ],
)
def test_sizes_read_like_mooncake_reads_them(text: int | str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "MB", "12 parsecs", "-1", "1e9"])
def test_bad_sizes_are_value_errors(text: str) -> None:
    with pytest.raises(ValueError, match="512MB"):
        parse_size(text)


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"master_server_address": "nohost"}, ValueError, "host:port"),
        ({"master_server_address": "h:99999"}, ValueError, "outside 1..65535"),
        ({"master_server_address": 50051}, TypeError, "host:port"),
        ({"protocol": "udp"}, ValueError, "tcp"),
        ({"timeout": 0}, ValueError, "> 0"),
        ({"timeout": float("inf")}, ValueError, "finite"),
        ({"timeout": "1"}, TypeError, "seconds"),
        ({"global_segment_size": -1}, ValueError, ">= 0"),
        ({"global_segment_size": "512MB"}, TypeError, "parse_size"),
        ({"protocol": ["tcp"]}, TypeError, "protocol must be text"),
        ({"local_buffer_size": 0}, ValueError, "> 0"),
        ({"local_hostname": ""}, ValueError, "local_hostname"),
    ],
)
def test_bad_values_are_clear_errors(fields: dict[str, object], error: type, match: str) -> None:
    args: dict[str, object] = {"master_server_address": "127.0.0.1:50051", **fields}
    with pytest.raises(error, match=match):
        MooncakeConfig(**args)  # type: ignore[arg-type]


def test_tenant_id_is_mooncakes_field_and_variable(tmp_path: Path) -> None:
    address = {"MOONCAKE_MASTER": "127.0.0.1:50051"}
    assert MooncakeConfig.from_env(address).tenant_id == "default"  # Mooncake's default
    assert MooncakeConfig.from_env({**address, "MOONCAKE_TENANT_ID": "beta"}).tenant_id == "beta"
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.1:50051", "tenant_id": "gamma"}))
    assert MooncakeConfig.from_env({"MOONCAKE_CONFIG_PATH": str(path)}).tenant_id == "gamma"
    with pytest.raises(ValueError, match="tenant_id"):
        MooncakeConfig(master_server_address="127.0.0.1:50051", tenant_id="")
    with pytest.raises(TypeError, match="tenant_id"):
        MooncakeConfig(master_server_address="127.0.0.1:50051", tenant_id=7)  # type: ignore[arg-type]


def test_replica_num_is_mooncakes_field_and_variable(tmp_path: Path) -> None:
    address = {"MOONCAKE_MASTER": "127.0.0.1:50051"}
    assert MooncakeConfig.from_env(address).replica_num == 1
    assert MooncakeConfig.from_env({**address, "MOONCAKE_REPLICA_NUM": "2"}).replica_num == 2
    assert MooncakeConfig.from_env({**address, "MOONCAKE_REPLICA_NUM": " 3 "}).replica_num == 3
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.1:50051", "replica_num": 2}))
    assert MooncakeConfig.from_env({"MOONCAKE_CONFIG_PATH": str(path)}).replica_num == 2
    for text in ("two", "-1", "1.5", "٣"):
        with pytest.raises(ValueError, match="MOONCAKE_REPLICA_NUM"):
            MooncakeConfig.from_env({**address, "MOONCAKE_REPLICA_NUM": text})
    with pytest.raises(ValueError, match="replica_num"):
        MooncakeConfig(master_server_address="127.0.0.1:50051", replica_num=0)
    with pytest.raises(TypeError, match="replica_num"):
        MooncakeConfig(master_server_address="127.0.0.1:50051", replica_num=True)
    with pytest.raises(TypeError, match="replica_num"):
        MooncakeConfig(master_server_address="127.0.0.1:50051", replica_num="2")  # type: ignore[arg-type]


def test_trusted_network_and_max_entry_size_are_mmkeys_own_settings(tmp_path: Path) -> None:
    base = {"MOONCAKE_MASTER": "10.0.0.1:50051"}
    default = MooncakeConfig.from_env(base)
    assert (default.trusted_network, default.max_entry_size) == (False, 64 << 20)
    env = {**base, "MMKEY_TRUSTED_NETWORK": "1", "MMKEY_MAX_ENTRY_SIZE": "8MB"}
    config = MooncakeConfig.from_env(env)
    assert (config.trusted_network, config.max_entry_size) == (True, 8 << 20)
    assert MooncakeConfig.from_env(env, trusted_network=False).trusted_network is False
    with pytest.raises(ValueError, match="MMKEY_TRUSTED_NETWORK must be 0 or 1"):
        MooncakeConfig.from_env({**base, "MMKEY_TRUSTED_NETWORK": "yes"})
    with pytest.raises(ValueError, match="max_entry_size must be > 0"):
        MooncakeConfig(master_server_address="h:1", max_entry_size=0)
    with pytest.raises(TypeError):
        MooncakeConfig(master_server_address="h:1", trusted_network=1)  # type: ignore[arg-type]
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "h:1", "trusted_network": True}))
    assert MooncakeConfig.from_env({"MOONCAKE_CONFIG_PATH": str(path)}).trusted_network is False


def binding_config() -> ModuleType:
    """The installed binding's own config module, ``mooncake.mooncake_config`` (skips where
    the binding is not installed; a failure under ``MMKEY_REQUIRE_MOONCAKE``)."""
    try:
        return importlib.import_module("mooncake.mooncake_config")
    except ImportError as exc:
        reason = f"the Mooncake binding is not installed ({exc}); pip install 'mmkey[mooncake-cpu]'"
        if os.environ.get(REQUIRE_ENV, "") not in ("", "0"):
            pytest.fail(f"{REQUIRE_ENV} is set but {reason}", pytrace=False)
        pytest.skip(reason)


def test_the_protocols_are_the_bindings_own_list() -> None:
    known = binding_config()._KNOWN_PROTOCOLS  # what the binding's config accepts without a warning
    assert known == mooncake_config._PROTOCOLS
    assert mooncake_config._UNUSABLE_PROTOCOLS.keys() <= known
    for protocol in sorted(known - mooncake_config._UNUSABLE_PROTOCOLS.keys()):
        assert MooncakeConfig(master_server_address="h:1", protocol=protocol).protocol == protocol


@pytest.mark.parametrize("text", ["RDMA", "Tcp", " efa ", "NVLINK_INTRA", "Sunrise_Link"])
def test_protocols_are_read_in_any_case_as_the_binding_reads_them(text: str) -> None:
    theirs = binding_config().MooncakeConfig(
        local_hostname="h",
        metadata_server="P2PHANDSHAKE",
        global_segment_size=0,
        local_buffer_size=1,
        protocol=text,
        device_name="",
        master_server_address="h:1",
    )
    ours = MooncakeConfig(master_server_address="h:1", protocol=text)
    assert ours.protocol == theirs.protocol == text.strip().lower()
    assert ours.setup_args()[4] == ours.protocol  # what reaches the engine, whose match is exact


def test_protocol_case_is_normalised_without_the_binding() -> None:
    assert MooncakeConfig(master_server_address="h:1", protocol="RDMA").protocol == "rdma"
    assert MooncakeConfig.from_env({"MOONCAKE_MASTER": "h:1", "MOONCAKE_PROTOCOL": "Tcp"}).protocol == "tcp"
    with pytest.raises(ValueError, match="must be one of .*'tcp'.*got 'udp'"):
        MooncakeConfig(master_server_address="h:1", protocol="UDP")
    with pytest.raises(ValueError, match="protocol must be one of"):
        MooncakeConfig(master_server_address="h:1", protocol=" ")


@pytest.mark.parametrize("text", ["rpc_only", "RPC_ONLY"])
def test_rpc_only_is_known_but_refused_naming_the_fix(text: str) -> None:
    with pytest.raises(ValueError, match="'rpc_only': Mooncake's store-only mode .* use tcp or rdma"):
        MooncakeConfig(master_server_address="h:1", protocol=text)


RPC_ONLY_ROUND_TRIP = """
import sys
from mooncake.store import MooncakeDistributedStore

store = MooncakeDistributedStore()
args = ("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "rpc_only", "", sys.argv[1])
if store.setup(*args) == 0 and store.put("k", b"entry") == 0 and store.get("k") == b"entry":
    print("round trip")
"""


def test_rpc_only_cannot_move_an_entry_through_the_binding(mooncake_master_session: MasterProcess) -> None:
    # why rpc_only is refused, measured: if this fails, the binding moves entries with it now
    binding_config()
    done = subprocess.run(
        [sys.executable, "-c", RPC_ONLY_ROUND_TRIP, mooncake_master_session.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "round trip" not in done.stdout
    assert done.returncode != 0  # 0.3.13.post1: a segmentation fault in setup


def test_read_fields_takes_each_fields_first_source_that_has_it() -> None:
    from mmkey.cache.mooncake.config import FILE, Env, Source, read_fields

    table: dict[str, tuple[Source, ...]] = {
        "a": (Env("A"), FILE),
        "b": (FILE, Env("B", without_file=True)),
        "c": (Env("C1"), Env("C2"), FILE),
        "d": (Env("D"),),
    }
    env = {"A": "env-a", "B": "env-b", "C1": "", "C2": "env-c2", "D": ""}
    assert read_fields(table, env, None) == {"a": "env-a", "b": "env-b", "c": "env-c2"}
    assert read_fields(table, env, {"a": "f", "c": "f", "d": "f"}) == {"a": "env-a", "c": "env-c2"}
    assert read_fields(table, {}, {"a": 0, "b": "", "x": 1}) == {"a": 0, "b": ""}  # any file value counts


def test_from_env_precedence_keyword_then_variable_then_file_then_default(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps({"master_server_address": "127.0.0.1:1", "protocol": "rdma", "device_name": "d0"})
    )
    env = {
        "MOONCAKE_CONFIG_PATH": str(path),
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_DEVICE": "",
        "MMKEY_CLAIM_WAIT": "3",
    }
    config = MooncakeConfig.from_env(env, master_server_address="127.0.0.1:2")
    assert config.master_server_address == "127.0.0.1:2"  # the keyword
    assert config.protocol == "tcp" and config.device_name == "d0"  # the variable, the file
    assert config.tenant_id == "default" and config.claim_wait == 3.0  # the default, mmkey's variable
    assert MooncakeConfig.from_env(env, claim_wait=0.5).claim_wait == 0.5
