"""SGLang's real encode servers serve embeddings through mmkey's store, faults included.

``scripts/sglang_e2e.py --device cpu`` (the script ``scripts/gpu-check.sh`` runs on a GPU)
starts a real master and holder and four real SGLang 0.5.23 encode servers on a tiny
random-weight Qwen2-VL it builds, runs every scenario once and prints its evidence; each
test here reads one scenario's. Runs in SGLang's environment (``make test-sglang-engine``),
with the CPU patch of ``patches/`` applied there; skips elsewhere unless MMKEY_REQUIRE_SGLANG=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.sglang.sglang_support import require_sglang

require_sglang()

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "sglang_e2e.py"
RUN_TIMEOUT = 900


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The script's evidence of one run of every scenario (the servers' logs kept beside it)."""
    logs = tmp_path_factory.mktemp("sglang-e2e-logs")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--keep", str(logs)],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
        env=dict(os.environ, MC_LOG_LEVEL="ERROR"),
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"the script printed no evidence (exit {done.returncode}): {done.stderr[-3000:]}"
    seen: dict[str, Any] = json.loads(lines[-1])
    assert "error" not in seen, seen["error"]
    seen["logs"] = str(logs)
    return seen


def scenario(run: dict[str, Any], name: str) -> dict[str, Any]:
    found: dict[str, Any] = run["scenarios"][name]
    assert found.get("errors") == [], found.get("errors")
    assert all(found["healthy"].values()), f"a server is unhealthy after {name}: {found['healthy']}"
    return found


def test_every_server_ran_on_the_cpu_with_mmkeys_store(run: dict[str, Any]) -> None:
    assert run["device"] == "cpu"
    assert "--device" in run["server_options"] and "sdpa" in run["server_options"]
    texts = {name: (Path(run["logs"]) / f"server-{name}.log").read_text(errors="replace") for name in "abc"}
    for name, text in texts.items():
        assert "mmkey SGLang store: namespace=" in text, f"server {name} did not build mmkey's store"
        assert "I/O thread waits for work instead of polling" in text, f"server {name} polls its queues"
    assert "hashes=blake3" in texts["c"] and "hashes=sglang" in texts["a"]


def test_no_server_logged_a_traceback(run: dict[str, Any]) -> None:
    assert run["tracebacks"] == {"a": 0, "b": 0, "c": 0, "ref": 0}


def test_an_image_encoded_on_one_server_is_served_by_another_from_the_store(run: dict[str, Any]) -> None:
    hit = scenario(run, "hit")
    assert hit["a"]["misses"] == 1 and hit["a_stored"] == 1
    assert hit["b"]["global_hits"] == 1 and hit["b"]["misses"] == 0 and hit["b_fetched"] == 1
    [key] = hit["new_keys"]
    assert key.startswith("mmk1@tiny-qwen2-vl%40e2e@image@sglang@")
    digests = hit["digests"]
    assert digests["b"] == digests["a"] == digests["ref"] != ""  # the same bytes as without any cache
    assert hit["bytes"] > 0


def test_a_damaged_entry_is_encoded_again_with_the_right_bytes(run: dict[str, Any]) -> None:
    damaged = scenario(run, "damaged")
    assert damaged["b"]["global_hits"] == 1  # SGLang counts the present key as a hit ...
    assert damaged["b_fetched"] == 0 and damaged["fallbacks"] == 1  # ... mmkey refuses it: the tower runs
    assert damaged["digests"]["b"] == damaged["digests"]["ref"] != ""


def test_an_entry_forged_without_the_fleet_secret_is_never_served(run: dict[str, Any]) -> None:
    forged = scenario(run, "forged")
    digests = forged["digests"]
    assert digests["b"] == digests["ref"] == digests["a"] != ""
    assert digests["b"] != digests["forged"]
    assert forged["fallbacks"] == 1


def test_mmkeys_refusals_are_logged_where_an_operator_looks(run: dict[str, Any]) -> None:
    text = (Path(run["logs"]) / "server-b.log").read_text(errors="replace")
    assert "did not verify, served as misses" in text and "forged" in text


def test_another_namespace_sees_nothing_and_blake3_gives_128_bit_keys_end_to_end(run: dict[str, Any]) -> None:
    other = scenario(run, "namespace")
    assert other["c"]["global_hits"] == 0 and other["c"]["misses"] == 1  # a stored this image in its own
    [key] = other["new_keys"]
    assert key.startswith("mmk1@tiny-qwen2-vl%40e2e-blake3@image@blake3@")
    assert other["blake3"] == [True] and other["digest_bits"][0] > 64
    digests = other["digests"]
    assert digests["c"] == digests["ref"] == digests["read_back"] != ""  # what c served, stored, read back


def test_one_image_asked_of_two_servers_at_once_is_encoded_once_and_served_right(run: dict[str, Any]) -> None:
    """Single-flight: one server claims the image and encodes it, the other waits for its
    entry and serves it as a global hit."""
    both = scenario(run, "concurrent_and_batch")["concurrent"]
    assert len(both["new_keys"]) == 1
    assert both["digests"]["a"] == both["digests"]["b"] == both["digests"]["ref"] != ""
    assert both["a"]["misses"] + both["b"]["misses"] == 1  # one encode across the two servers
    assert both["a"]["global_hits"] + both["b"]["global_hits"] == 1
    encoder = "a" if both["a"]["misses"] == 1 else "b"
    waiter = "b" if encoder == "a" else "a"
    # it waited for the claimant's entry, or (on a crowded host) asked once it had landed
    assert both["waits"][waiter] in (
        {"lines": 1, "items": 1, "served": 1, "encoded": 0},
        {"lines": 0, "items": 0, "served": 0, "encoded": 0},
    )
    assert both["waits"][encoder]["lines"] == 0  # the claimant never waits
    assert both["fetched"] == 1  # the waiter read the claimant's entry from the store


def test_a_batch_with_one_image_missing_fetches_the_others_and_encodes_that_one(run: dict[str, Any]) -> None:
    found = scenario(run, "concurrent_and_batch")
    assert len(found["batch_stored_first"]) == 2
    assert found["batch"] == {"lines": 1, "total": 3, "local_hits": 0, "global_hits": 2, "misses": 1}
    assert found["batch_digests"]["b"] == found["batch_digests"]["ref"] != ""


def test_a_callers_own_hash_never_gets_another_images_embedding_served(run: dict[str, Any]) -> None:
    found = scenario(run, "caller_hashes")
    assert found["hash_method_checked"], "the script's copy of SGLang's hash did not match the server's"
    assert (
        found["digests"]["sent"] == found["digests"]["ref_sent"]
    )  # the caller got its own pixels' embedding
    assert found["caller_schemes"] == ["id"]  # stored apart from the server's own hashes
    assert found["b"]["global_hits"] == 0 and found["b"]["misses"] == 1
    assert found["digests"]["b"] == found["digests"]["ref"] != ""  # the honest request: its own image


def test_a_dead_master_costs_a_recompute_within_the_bound(run: dict[str, Any]) -> None:
    dead = scenario(run, "dead_master")
    assert len(dead["new_keys"]) == 1
    assert dead["seconds"] < dead["bound"]
    assert dead["b"]["misses"] + dead["b"]["global_hits"] == 1
    assert dead["digests"]["b"] == dead["digests"]["ref"] != ""


def test_every_scenario_held_by_the_scripts_own_verdict(run: dict[str, Any]) -> None:
    """The script's verdict (what gpu-check.sh reports on a GPU) agrees with the tests above."""
    assert {name: found["held"] for name, found in run["scenarios"].items()} == dict.fromkeys(
        ("hit", "damaged", "forged", "namespace", "concurrent_and_batch", "caller_hashes", "dead_master"),
        True,
    )
    assert run["ok"] is True


def test_the_environments_sglang_carries_the_cpu_patch() -> None:
    """scripts/sglang-env.sh applied patches/sglang-0.5.23-cpu-global-cache.patch: it reverses
    cleanly on the installed SGLang (a dry run; nothing is changed)."""
    import shutil

    import sglang

    if shutil.which("patch") is None:
        pytest.skip("needs the patch program")
    patch_file = SCRIPT.parents[1] / "patches" / "sglang-0.5.23-cpu-global-cache.patch"
    site = Path(sglang.__file__).parents[1]
    done = subprocess.run(
        ["patch", "-p1", "-R", "--dry-run", "-d", str(site), "-i", str(patch_file)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
