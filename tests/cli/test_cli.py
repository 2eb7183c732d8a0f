"""The ``mmkey`` command: its exit status and output, as a user sees them.

Most commands run in this process through click's runner (stdout and stderr apart; an
exception the command does not handle fails the test with its traceback), which spares each
run a fresh interpreter importing torch. The console script, ``python -m mmkey``, the main
job (``mmkey demo``), and what must hold in a fresh interpreter (no torch for ``mmkey key``,
the message without the ``cli`` extra) run as subprocesses, as a user runs them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from mmkey import EmbeddingKey, HashScheme, Modality, hash_tensor, mm_hash
from mmkey.cli import cli
from mmkey.encoder import hashes_from_features
from mmkey.testing.mooncake_master import MasterProcess

KEY = EmbeddingKey("qwen2-vl-7b@rev1", Modality.IMAGE, HashScheme.BLAKE3, mm_hash(12345))
SGLANG_KEY = EmbeddingKey("m", Modality.AUDIO, HashScheme.SGLANG, mm_hash(2**64 - 1))
TERMINAL = {"COLUMNS": "200", "NO_COLOR": "1"}
"""A wide, plain terminal."""


class Ran(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def mmkey(*args: str, stdin: str | None = None, env: Mapping[str, str | None] | None = None) -> Ran:
    """Run ``mmkey ARGS`` in this process (``None`` in `env` unsets a variable)."""
    environ = {**TERMINAL, **(env or {})}
    runner = CliRunner()
    result = runner.invoke(cli, list(args), stdin, environ, catch_exceptions=False, prog_name="mmkey")
    return Ran(result.exit_code, result.stdout, result.stderr)


def mmkey_process(*args: str) -> Ran:
    """Run ``python -m mmkey ARGS`` in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-m", "mmkey", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **TERMINAL},
    )
    return Ran(proc.returncode, proc.stdout, proc.stderr)


def assert_one_clean_error_line(proc: Ran, *fragments: str) -> None:
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    for fragment in fragments:
        assert fragment in lines[0]


def test_help_lists_the_commands_and_the_console_script_is_installed() -> None:
    proc = mmkey_process("--help")
    assert proc.returncode == 0
    for command in ("demo", "key", "hash", "bench"):
        assert command in proc.stdout
    script = Path(sys.executable).with_name("mmkey")
    assert script.exists()
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and "mmkey" in version.stdout


# mmkey key


def test_key_explains_each_part() -> None:
    proc = mmkey("key", KEY.to_key(), SGLANG_KEY.to_key())
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert KEY.to_key() in out
    assert "namespace  qwen2-vl-7b@rev1" in out
    assert "modality   image" in out
    assert "scheme     blake3 (128-bit" in out
    assert f"digest     {12345:032x} (decimal 12345)" in out
    assert "scheme     sglang (64-bit" in out and "ffffffffffffffff" in out


def test_key_json_round_trips() -> None:
    proc = mmkey("key", "--json", KEY.to_key())
    assert proc.returncode == 0
    record = json.loads(proc.stdout)
    assert record["namespace"] == KEY.namespace and record["digest_decimal"] == "12345"
    assert EmbeddingKey.from_key(record["key"]) == KEY


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("12345", "bare decimal digest"),
        ("mmk1@m@image@blake3@00", "zero-padded to 32"),
        ("mmk1@m@photo@blake3@" + "0" * 32, "modality must be one of"),
        ("emb_12345", "must start with 'mmk1@'"),
        ("mmk1@a/b@image@blake3@" + "0" * 32, "percent-encoded"),
    ],
)
def test_a_bad_key_is_one_line_and_exit_status_2(text: str, fragment: str) -> None:
    assert_one_clean_error_line(mmkey("key", text), "mmkey key: error:", fragment)


def test_good_keys_are_still_shown_next_to_a_bad_one() -> None:
    proc = mmkey("key", KEY.to_key(), "nonsense")
    assert proc.returncode == 2
    assert KEY.to_key() in proc.stdout and "nonsense" in proc.stderr


def test_keys_from_stdin_one_per_line() -> None:
    proc = mmkey("key", "-", stdin=f"{KEY.to_key()}\n\n{SGLANG_KEY.to_key()}\r\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("format     v1") == 2


def test_key_without_arguments_is_a_usage_error() -> None:
    proc = mmkey("key")
    assert proc.returncode == 2 and "Missing argument" in proc.stderr


def test_key_does_not_load_torch() -> None:
    code = (
        "import sys\nfrom mmkey.cli import cli\n"
        f"cli(['key', {KEY.to_key()!r}], standalone_mode=False)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("absent", [("click",), ("rich",), ("click", "rich")])
def test_without_the_cli_extra_mmkey_names_the_install_command(absent: tuple[str, ...]) -> None:
    # a module set to None in sys.modules is one that cannot be found
    code = (
        "import sys\n"
        f"for name in {absent!r}: sys.modules[name] = None\n"
        "from mmkey.cli import main\n"
        f"sys.argv = ['mmkey', 'key', {KEY.to_key()!r}]\n"
        "main()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc
    assert proc.stdout == ""
    assert "pip install 'mmkey[cli]'" in proc.stderr
    assert " and ".join(absent) in proc.stderr
    assert "Traceback" not in proc.stderr


# mmkey hash


def test_hash_prints_the_digest_of_a_saved_tensor(tmp_path: Path) -> None:
    t = torch.randn(16, 12)
    torch.save(t, tmp_path / "t.pt")
    proc = mmkey("hash", str(tmp_path / "t.pt"))
    assert proc.returncode == 0, proc.stderr
    digest, name, described = proc.stdout.rstrip("\n").split("  ")
    assert digest == f"{hash_tensor(t):032x}"
    assert (name, described) == (str(tmp_path / "t.pt"), "float32[16, 12]")


def test_hash_with_a_namespace_prints_keys_that_parse(tmp_path: Path) -> None:
    t = torch.arange(10)
    torch.save(t, tmp_path / "t.pt")
    proc = mmkey("hash", "-n", "qwen@1", "-s", "xxh3", "-m", "video", str(tmp_path / "t.pt"))
    assert proc.returncode == 0, proc.stderr
    key = EmbeddingKey.from_key(proc.stdout.split()[0])
    digest = hash_tensor(t, HashScheme.XXH3)
    assert key == EmbeddingKey("qwen@1", Modality.VIDEO, HashScheme.XXH3, digest)


def test_hash_gives_per_item_digests_of_a_processor_output(tmp_path: Path) -> None:
    pixel_values = torch.randn(4 + 16, 8)
    grid = torch.tensor([[1, 2, 2], [1, 4, 4]])
    torch.save({"pixel_values": pixel_values, "image_grid_thw": grid}, tmp_path / "batch.pt")
    proc = mmkey("hash", "--json", "-n", "m", str(tmp_path / "batch.pt"))
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    items = [r for r in records if "#" in r["name"]]
    expected = hashes_from_features(pixel_values, grid)
    assert [int(r["digest"], 16) for r in items] == expected
    assert [r["tensor"] for r in items] == ["item grid=(1,2,2)", "item grid=(1,4,4)"]
    assert {r["name"].split(":")[-1] for r in records} >= {"pixel_values", "image_grid_thw"}


def test_hash_reads_numpy_files(tmp_path: Path) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save(tmp_path / "a.npy", a)
    np.savez(tmp_path / "b.npz", x=a, y=np.ones(4, dtype=np.int16))
    proc = mmkey("hash", "--scheme", "sglang", str(tmp_path / "a.npy"), str(tmp_path / "b.npz"))
    assert proc.returncode == 0, proc.stderr
    digest = f"{hash_tensor(torch.from_numpy(a), HashScheme.SGLANG):016x}"
    lines = proc.stdout.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(digest) and lines[1].startswith(digest)
    assert lines[2].endswith(":y  int16[4]")


def test_hash_of_an_unreadable_file_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    (tmp_path / "junk.pt").write_text("not a tensor")
    assert_one_clean_error_line(mmkey("hash", str(tmp_path / "junk.pt")), "junk.pt: not a tensor file")
    assert_one_clean_error_line(mmkey("hash", str(tmp_path / "missing.pt")), "missing.pt: cannot read")
    torch.save(torch.zeros(2), tmp_path / "t.pt")
    assert_one_clean_error_line(mmkey("hash", "-n", "", str(tmp_path / "t.pt")), "--namespace")


# mmkey demo and bench


def test_demo_runs_the_main_job_and_prints_a_summary() -> None:
    proc = mmkey_process("demo", "--requests", "6", "--pool", "3")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for row in (
        "requests",
        "hit rate",
        "encoder calls saved",
        "time with the cache",
        "time without the cache",
        "GB/s",
        "max |diff| 0.00e+00",
        "0 swallowed",
    ):
        assert row in out, row
    assert "memory (MemoryCache" in out
    encoded = int(_row(out, "encoder calls").split()[0])
    held = re.fullmatch(r"(\d+) entries, (\d+\.\d) MB", _row(out, "cache held"))
    assert held is not None, _row(out, "cache held")
    assert int(held[1]) == encoded > 0  # nothing is evicted from 256 MiB
    assert float(held[2]) > 0
    assert "written by this client" not in out


def _row(table: str, name: str) -> str:
    """The value cell of the summary row `name` (rich draws `│ name │ value │`)."""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 2 and cells[0] == name:
            return cells[1]
    raise AssertionError(f"no row {name!r} in:\n{table}")


def test_demo_on_mooncake_without_a_master_says_how_to_name_one() -> None:
    unset: dict[str, str | None] = {k: None for k in os.environ if k.startswith("MOONCAKE_")}
    proc = mmkey("demo", "--store", "mooncake", env=unset)
    assert proc.returncode == 2 and "MOONCAKE_MASTER" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.mooncake
def test_demo_on_a_real_mooncake_store(mooncake_master: MasterProcess) -> None:
    proc = mmkey(
        "demo",
        "--store",
        "mooncake",
        "--requests",
        "5",
        "--pool",
        "2",
        "--no-baseline",
        env={"MOONCAKE_MASTER": mooncake_master.address, "MC_LOG_LEVEL": "ERROR"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"mooncake ({mooncake_master.address})" in proc.stdout
    hits = next(line for line in proc.stdout.splitlines() if "cache hits" in line)
    assert int(hits.split()[-2]) > 0, hits
    assert "0 swallowed" in proc.stdout
    # a remote store's client does not pretend to know what the store holds
    assert _row(proc.stdout, "cache held").startswith("unknown")
    assert _row(proc.stdout, "written by this client") == "2 entries"
    assert "not asked" in _row(proc.stdout, "store, master's count")


@pytest.mark.mooncake
def test_demo_on_mooncake_reports_the_masters_counts(mooncake_master: MasterProcess) -> None:
    env = {"MOONCAKE_MASTER": mooncake_master.address, "MC_LOG_LEVEL": "ERROR"}
    metrics = f"127.0.0.1:{mooncake_master.metrics_port}"
    proc = mmkey(
        "demo",
        "--store",
        "mooncake",
        "--requests",
        "6",
        "--pool",
        "5",
        "--no-baseline",
        "--master-metrics",
        metrics,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    encoded = int(_row(proc.stdout, "encoder calls").split()[0])
    assert _row(proc.stdout, "written by this client") == f"{encoded} entries"
    usage = re.fullmatch(
        r"(\d+) keys, (\d+\.\d) MB of \d+ MB in 1 segment\(s\), all clients",
        _row(proc.stdout, "store, master's count"),
    )
    assert usage is not None, _row(proc.stdout, "store, master's count")
    assert int(usage[1]) == encoded and float(usage[2]) > 0  # only this demo wrote
    # a metrics endpoint that does not answer: said, not guessed
    silent = mmkey(
        "demo",
        "--store",
        "mooncake",
        "--requests",
        "2",
        "--pool",
        "2",
        "--no-baseline",
        "--master-metrics",
        "127.0.0.1:9",
        env=env,
    )
    assert silent.returncode == 0, silent.stderr[-2000:]
    assert _row(silent.stdout, "store, master's count").startswith("unknown: no answer")


def test_demo_refuses_a_malformed_metrics_address() -> None:
    proc = mmkey("demo", "--master-metrics", "nohost", "--requests", "1")
    assert proc.returncode == 2 and "--master-metrics" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_measures_each_scheme_against_memory_bandwidth() -> None:
    proc = mmkey("bench", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr
    for path in ("mmkey blake3", "mmkey xxh3", "mmkey sglang", "tensor.sum()"):
        assert path in proc.stdout
    assert "GB/s" in proc.stdout
