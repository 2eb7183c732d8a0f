"""The vLLM serving benchmark's arguments, without starting an engine."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
bench: Any = importlib.import_module("bench_serve")


def test_rows_name_their_engines_and_unknown_rows_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    full = bench.parse_args([])
    assert full.rows.split(",") == list(bench.ROW_ENGINES) and full.requests == 96
    assert bench.ROW_ENGINES["none"] == bench.ROW_ENGINES["in-engine"], "both run without a connector"
    quick = bench.parse_args(["--quick"])
    assert (quick.requests, quick.clients, quick.reuse) == (24, "1,16", "0.8")
    with pytest.raises(SystemExit):
        bench.parse_args(["--rows", "none,sglang"])
    assert "unknown rows: sglang" in capsys.readouterr().err


def test_at_one_client_rows_on_engines_of_their_own_take_turns() -> None:
    assert bench.taking_turns(["none", "in-engine", "vllm-store", "mmkey"]) == ["none", "vllm-store", "mmkey"]
    assert bench.taking_turns(["in-engine", "mmkey", "none"]) == ["in-engine", "mmkey"]
    assert bench.taking_turns(["mmkey"]) == ["mmkey"]
