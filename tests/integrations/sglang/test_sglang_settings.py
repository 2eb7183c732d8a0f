"""The SGLang integration's settings (mmkey.integrations.sglang._store_settings): the switch, the hash
mode, SGLang's version, and the Mooncake configuration read as SGLang's own backend reads it.

Needs no SGLang: these run in every environment.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmkey import HashScheme
from mmkey.integrations.sglang._store_settings import (
    SGLangConfigError,
    check_sglang_version,
    config_from_env,
    hash_mode,
    namespace_from_env,
    opted_in,
    settings_from_env,
    switch_problem,
)


@pytest.mark.parametrize("value", ["", "0"])
def test_unset_empty_or_zero_does_not_opt_in(value: str) -> None:
    assert not opted_in({"MMKEY_SGLANG_BACKEND": value})
    assert switch_problem({"MMKEY_SGLANG_BACKEND": value}) is None
    assert not opted_in({})


@pytest.mark.parametrize("value", ["1", "true", "YES", "on", "mmkey"])
def test_plain_on_values_opt_in_without_a_problem(value: str) -> None:
    assert opted_in({"MMKEY_SGLANG_BACKEND": value})
    assert switch_problem({"MMKEY_SGLANG_BACKEND": value}) is None


@pytest.mark.parametrize("value", ["false", "off", "no", "00", " 0", "2", "mooncake"])
def test_any_other_value_opts_in_and_is_a_configuration_error(value: str) -> None:
    assert opted_in({"MMKEY_SGLANG_BACKEND": value})
    problem = switch_problem({"MMKEY_SGLANG_BACKEND": value})
    assert isinstance(problem, SGLangConfigError)
    assert "MMKEY_SGLANG_BACKEND=1" in str(problem) and repr(value) in str(problem)


def test_hash_mode() -> None:
    assert hash_mode({}) is HashScheme.SGLANG
    assert hash_mode({"MMKEY_SGLANG_HASH": "BLAKE3"}) is HashScheme.BLAKE3
    with pytest.raises(SGLangConfigError, match="MMKEY_SGLANG_HASH=blake3"):
        hash_mode({"MMKEY_SGLANG_HASH": "sha256"})


def test_namespace_is_required_and_checked() -> None:
    assert namespace_from_env({"MMKEY_NAMESPACE": "qwen@1"}) == "qwen@1"
    with pytest.raises(SGLangConfigError, match="MMKEY_NAMESPACE is not set"):
        namespace_from_env({})
    with pytest.raises(SGLangConfigError, match="MMKEY_NAMESPACE="):
        namespace_from_env({"MMKEY_NAMESPACE": "m" * 300})


@pytest.mark.parametrize("version", ["0.5.23", "0.5.23.post1", "0.5.23+cu128", "0.5.23.0"])
def test_tested_versions_pass(version: str) -> None:
    check_sglang_version(version)


@pytest.mark.parametrize(
    "version",
    ["0.5.22", "0.5.24", "0.6.0", "1.0.0", "0.0.0.dev0", "unknown", "", "0.5.23junk"]
    + ["0.5.23rc1", "0.5.23.dev0", "0.5.23a1", "0.5.24rc1"],  # PEP 440: outside >=0.5.23,<0.5.24
)
def test_other_versions_are_refused_naming_the_fix(version: str) -> None:
    with pytest.raises(SGLangConfigError, match=r"install sglang==0\.5\.23"):
        check_sglang_version(version)


def test_sglangs_defaults_when_only_the_master_is_set() -> None:
    config = config_from_env({"MOONCAKE_MASTER": "10.0.0.5:50051"})
    assert config.master_server_address == "10.0.0.5:50051"
    assert config.protocol == "rdma"  # SGLang's default, not mmkey's tcp
    assert config.global_segment_size == 4 << 30
    assert config.local_hostname == "localhost"
    assert config.metadata_server == "P2PHANDSHAKE"
    assert config.device_name == ""
    assert config.tenant_id == "default"
    assert config.timeout == 2.0


def test_sglangs_variables_are_honoured() -> None:
    config = config_from_env(
        {
            "MOONCAKE_MASTER": "10.0.0.5:50051",
            "MOONCAKE_PROTOCOL": "efa",
            "MOONCAKE_DEVICE": "rdmap0s6",
            "MOONCAKE_TE_META_DATA_SERVER": "http://10.0.0.5:8080/metadata",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2gb",
            "MOONCAKE_TENANT_ID": "  ",
            "LOCAL_HOSTNAME": "10.0.0.7",
            "MMKEY_TIMEOUT": "0.75",
            "MOONCAKE_REPLICA_NUM": "2",
        }
    )
    assert (config.protocol, config.device_name) == ("efa", "rdmap0s6")
    assert config.metadata_server == "http://10.0.0.5:8080/metadata"
    assert config.global_segment_size == 2 << 30
    assert config.tenant_id == "default"  # SGLang reads blank as the default tenant
    assert config.local_hostname == "10.0.0.7"
    assert (config.timeout, config.replica_num) == (0.75, 2)
    both = {"MOONCAKE_MASTER": "m:1", "MOONCAKE_LOCAL_HOSTNAME": "a", "LOCAL_HOSTNAME": "b"}
    assert config_from_env(both).local_hostname == "a"  # SGLang: MOONCAKE_LOCAL_HOSTNAME first


def test_an_empty_mooncake_local_hostname_is_skipped_not_passed_on() -> None:
    # SGLang 0.5.23 passes a set-but-empty MOONCAKE_LOCAL_HOSTNAME to Mooncake as the host name
    # (envs.MOONCAKE_LOCAL_HOSTNAME.is_set()), and mooncake 0.3.13.post1's setup refuses an empty
    # one (-600, "local_hostname is empty"): mmkey goes on to the next source instead
    env = {"MOONCAKE_MASTER": "m:1", "MOONCAKE_LOCAL_HOSTNAME": ""}
    assert config_from_env(env).local_hostname == "localhost"
    assert config_from_env({**env, "LOCAL_HOSTNAME": "10.0.0.7"}).local_hostname == "10.0.0.7"


@pytest.mark.parametrize(("text", "protocol"), [("RDMA", "rdma"), ("Tcp", "tcp"), (" efa ", "efa")])
def test_the_protocol_is_read_in_any_case_as_mooncakes_config_reads_it(text: str, protocol: str) -> None:
    settings = settings_from_env({"MOONCAKE_MASTER": "m:1", "MOONCAKE_PROTOCOL": text})
    assert settings.config.protocol == protocol
    assert f"protocol={protocol} " in settings.describe()


def test_rpc_only_is_a_configuration_error_naming_the_fix(tmp_path: Path) -> None:
    with pytest.raises(SGLangConfigError, match="protocol 'rpc_only': .* use tcp or rdma"):
        config_from_env({"MOONCAKE_MASTER": "m:1", "MOONCAKE_PROTOCOL": "rpc_only"})
    path = write(tmp_path, {"master_server_address": "m:1", "protocol": "RPC_ONLY"})
    with pytest.raises(SGLangConfigError, match=r"\(file .*\): MooncakeConfig.protocol 'rpc_only'"):
        config_from_env({"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": path})


def write(tmp_path: Path, data: object) -> str:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_sglangs_config_file_is_honoured_over_the_variables(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "master_server_address": "10.0.0.9:50051",
            "local_hostname": "10.0.0.3",
            "global_segment_size": 1 << 30,
            "device_name": "mlx5_0",
            "tenant_id": "team-a",
            "check_server": False,  # SGLang's own fields the store does not use are ignored
        },
    )
    settings = settings_from_env(
        {
            "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": path,
            "MOONCAKE_MASTER": "elsewhere:1",
            "MOONCAKE_PROTOCOL": "tcp",
        }
    )
    config = settings.config
    assert config.master_server_address == "10.0.0.9:50051"  # the file wins, as in SGLang
    assert config.protocol == "tcp"  # the file has none: SGLang falls back to MOONCAKE_PROTOCOL
    assert (config.local_hostname, config.global_segment_size) == ("10.0.0.3", 1 << 30)
    assert (config.device_name, config.tenant_id) == ("mlx5_0", "team-a")
    assert settings.source == f"file {path}"
    assert f"(from file {path})" in settings.describe() and "protocol=tcp" in settings.describe()
    # SGLang: the process's host name variables win over the shared file
    assert (
        config_from_env({"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": path, "LOCAL_HOSTNAME": "h"}).local_hostname
        == "h"
    )
    assert config_from_env({"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": path}).protocol == "rdma"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "set MOONCAKE_MASTER=host:port"),
        ({"MOONCAKE_CLIENT": "10.0.0.5:50052"}, "standalone mooncake_client"),
        ({"MOONCAKE_MASTER": "m:1", "MOONCAKE_PROTOCOL": "smoke-signals"}, "protocol must be one of"),
        ({"MOONCAKE_MASTER": "m:1", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "lots"}, "cannot read 'lots' as a size"),
        ({"MOONCAKE_MASTER": "m:1", "MMKEY_TIMEOUT": "-1"}, "MMKEY_TIMEOUT='-1' must be a positive"),
        ({"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": "/nonexistent/mc.json"}, "cannot read a JSON config"),
    ],
)
def test_what_the_store_cannot_use_is_a_configuration_error_naming_the_fix(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(SGLangConfigError, match=message):
        config_from_env(env)


def test_a_config_file_without_a_master_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SGLangConfigError, match="names no master_server_address"):
        config_from_env({"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": write(tmp_path, {"protocol": "tcp"})})
    path = write(tmp_path, {"client_server_address": "c:1"})
    with pytest.raises(SGLangConfigError, match="standalone mooncake_client"):
        config_from_env({"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": path})


def test_mooncake_client_beside_a_master_is_noted_not_used() -> None:
    settings = settings_from_env({"MOONCAKE_MASTER": "m:1", "MOONCAKE_CLIENT": "c:2"})
    assert settings.config.master_server_address == "m:1"
    assert "MOONCAKE_CLIENT=c:2 not used" in settings.describe()


def test_mooncake_variables_are_read_only_the_sglang_way() -> None:
    # MOONCAKE_CONFIG_PATH is Mooncake's own file variable, which SGLang's backend does not read
    settings = settings_from_env(
        {"MOONCAKE_MASTER": "m:1", "MOONCAKE_CONFIG_PATH": "/nonexistent/mooncake.json"}
    )
    assert settings.config.master_server_address == "m:1"
    assert (
        "MOONCAKE_CONFIG_PATH not read (SGLang's backend reads SGLANG_HICACHE_MOONCAKE_CONFIG_PATH)"
        in settings.describe()
    )


def test_single_flight_is_on_by_default_and_mmkey_claim_wait_sets_its_bound() -> None:
    default = settings_from_env({"MOONCAKE_MASTER": "m:1"})
    assert default.config.claim_wait == 2.0 and "claim_wait=2.0s" in default.describe()
    settings = settings_from_env({"MOONCAKE_MASTER": "m:1", "MMKEY_CLAIM_WAIT": "0.5"})
    assert settings.config.claim_wait == 0.5 and "claim_wait=0.5s" in settings.describe()
    assert settings_from_env({"MOONCAKE_MASTER": "m:1", "MMKEY_CLAIM_WAIT": "0"}).config.claim_wait == 0
    with pytest.raises(SGLangConfigError, match="MMKEY_CLAIM_WAIT"):
        settings_from_env({"MOONCAKE_MASTER": "m:1", "MMKEY_CLAIM_WAIT": "soon"})


@pytest.mark.parametrize("version", ["0.5.23.post1.dev0", "0.5.23.1rc1"])
def test_a_pre_release_inside_the_tested_range_passes_as_pip_takes_it(version: str) -> None:
    """PEP 440 pre-releases above 0.5.23 and below 0.5.24 are in the extra's range for pip."""
    check_sglang_version(version)


def test_a_timeout_that_is_not_a_number_is_a_configuration_error() -> None:
    with pytest.raises(SGLangConfigError, match=r"MMKEY_TIMEOUT='soon' is not a number of seconds"):
        config_from_env({"MOONCAKE_MASTER": "m:1", "MMKEY_TIMEOUT": "soon"})


def test_with_a_config_file_the_variables_it_replaces_are_not_read(tmp_path: Path) -> None:
    """SGLang reads its file or else the MOONCAKE_* variables: a field the file lacks takes
    SGLang's default, never the variable."""
    path = write(tmp_path, {"master_server_address": "10.0.0.9:50051"})
    config = config_from_env(
        {
            "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": path,
            "MOONCAKE_MASTER": "elsewhere:1",
            "MOONCAKE_DEVICE": "rdmap0s6",
            "MOONCAKE_TE_META_DATA_SERVER": "http://10.0.0.5:8080/metadata",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2gb",
            "MOONCAKE_TENANT_ID": "team-b",
        }
    )
    assert config.master_server_address == "10.0.0.9:50051"
    assert (config.device_name, config.metadata_server) == ("", "P2PHANDSHAKE")
    assert (config.global_segment_size, config.tenant_id) == (4 << 30, "default")
