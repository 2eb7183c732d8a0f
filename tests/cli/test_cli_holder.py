"""``mmkey holder``: a real segment-holder process, run as a user runs it."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mmkey.testing.fleet import _master_segments
from mmkey.testing.mooncake_master import MasterProcess, _free_port
from tests._support import wait_until

HOLDER_ENV = {"COLUMNS": "200", "NO_COLOR": "1", "MC_LOG_LEVEL": "ERROR"}


def _mmkey(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    return subprocess.run(
        [sys.executable, "-m", "mmkey", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, **HOLDER_ENV, **(env or {})},
    )


def test_print_command_reads_flags_and_mooncake_variables() -> None:
    proc = _mmkey(
        "holder",
        "--print-command",
        "--port",
        "50099",
        "--http-port",
        "9399",
        env={
            "MOONCAKE_MASTER": "127.0.0.1:50051",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1GB",
            "MOONCAKE_LOCAL_HOSTNAME": "10.0.0.7",
        },
    )
    assert proc.returncode == 0, proc.stderr
    argv = shlex.split(proc.stdout)
    assert Path(argv[0]).name == "mooncake_client"
    assert argv[1:] == [
        "--host=10.0.0.7",
        "--port=50099",
        "--master_server_address=127.0.0.1:50051",
        "--metadata_server=P2PHANDSHAKE",
        f"--global_segment_size={1 << 30}",
        "--protocol=tcp",
        "--enable_http_server=true",
        "--http_port=9399",
    ]
    flags_win = _mmkey(
        "holder",
        "--print-command",
        "--master",
        "127.0.0.1:6000",
        "--global-segment-size",
        "64MB",
        env={"MOONCAKE_MASTER": "127.0.0.1:50051"},
    )
    assert "--master_server_address=127.0.0.1:6000" in flags_win.stdout
    assert f"--global_segment_size={64 << 20}" in flags_win.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ((), "MOONCAKE_MASTER"),
        (("--master", "127.0.0.1:1", "--global-segment-size", "0"), "lend memory"),
        (("--master", "127.0.0.1:1", "--global-segment-size", "lots"), "'512MB'"),
        (("--master", "nohost"), "host:port"),
    ],
)
def test_bad_settings_are_one_clean_error_line(args: tuple[str, ...], fragment: str) -> None:
    proc = _mmkey("holder", *args)
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmkey holder: error:"), lines
    assert fragment in lines[0]


@pytest.mark.mooncake
def test_entries_outlive_the_writer_while_the_holder_runs(mooncake_master: MasterProcess) -> None:
    from mooncake.store import MooncakeDistributedStore

    before = _master_segments(mooncake_master)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mmkey",
            "holder",
            "--port",
            str(_free_port()),
            "--global-segment-size",
            "64MB",
        ],
        env={**environ, **HOLDER_ENV, "MOONCAKE_MASTER": mooncake_master.address},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert wait_until(lambda: _master_segments(mooncake_master) - before, 20), "no segment mounted"
        assert Path(f"/proc/{proc.pid}/comm").read_text().strip() == "mooncake_client"
        args = ("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", mooncake_master.address)
        writer = MooncakeDistributedStore()
        assert writer.setup(*args) == 0
        assert writer.put("outlives-its-writer", b"entry" * 100) == 0
        writer.close()  # a pure client: the entry lives in the holder, not in the writer
        reader = MooncakeDistributedStore()
        assert reader.setup(*args) == 0
        assert reader.get("outlives-its-writer") == b"entry" * 100
        reader.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        assert "lending 64 MiB" in (proc.stderr.read() if proc.stderr else "")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_holder_is_listed_and_explains_itself() -> None:
    listed = _mmkey("--help")
    assert listed.returncode == 0 and "holder" in listed.stdout
    proc = _mmkey("holder", "--help")
    assert proc.returncode == 0
    for option in (
        "--master",
        "--global-segment-size",
        "--port",
        "--http-port",
        "SIGTERM",
        "MOONCAKE_MASTER",
    ):
        assert option in proc.stdout, option
