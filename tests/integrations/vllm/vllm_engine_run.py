"""One real vLLM engine run, in a fresh process: ``python vllm_engine_run.py SPEC.json OUT.json``.

The spec names the model directory, the EC transfer config (or none), the prompts (text with
``<image>`` and the seed of a 32x32 image each) and engine options. The run writes the
generated token ids of every prompt, the number of images the vision tower encoded, the
connector's totals and each request's ``ec_transfer_params``. With ``"pause_file"`` set, the
run writes ``<pause_file>.ready`` after the engine is up and waits for ``pause_file`` to exist
before generating (a test does something to the store in between). With ``"round_params"``
(one list per round, one ``ec_transfer_params`` per prompt) each request carries its own
transfer params. With ``"barrier_dir"`` set, the run writes ``<dir>/<name>.ready-<k>`` before
round ``k`` and waits for ``<dir>/go-<k>``: two engines (a producer and its consumer) start each
round together. With ``"keepalive"`` set, a text-only request decodes beside each round's
requests until they are done (an engine whose requests all wait on the EC connector still
steps its model runner). ``python vllm_engine_run.py --serve`` runs one engine after another
in one process, one ``SPEC.json OUT.json`` line of stdin each. The repository root must be on
``PYTHONPATH``: the run and its engine's processes import ``tests.integrations.vllm.vllm_engine_model``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def image(seed: int, size: int = 32) -> Any:
    """A deterministic RGB image."""
    import importlib

    import numpy as np

    Image: Any = importlib.import_module("PIL.Image")

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")


def _connector(llm: Any) -> Any:
    from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

    return get_ec_transfer() if has_ec_transfer() else None


def generate_kept_busy(llm: Any, inputs: list[dict[str, Any]], params: list[Any], tag: str) -> list[Any]:
    """`inputs` generated beside a text-only request that keeps every engine step busy (one
    decoded token a step), dropped once the others are done: an engine whose requests all wait
    on the EC connector still runs its model runner. Outputs in the order of `inputs`."""
    import importlib

    SamplingParams = importlib.import_module("vllm").SamplingParams
    engine = llm.llm_engine
    ids = [f"{tag}-{i}" for i in range(len(inputs))]
    for request_id, prompt, sampling in zip(ids, inputs, params, strict=True):
        engine.add_request(request_id, prompt, sampling)
    busy = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0)
    keepalive = 0
    engine.add_request(f"{tag}-busy-{keepalive}", {"prompt": "describe the picture"}, busy)
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        for output in engine.step():
            if output.request_id in ids and output.finished:
                done[output.request_id] = output
            elif output.request_id == f"{tag}-busy-{keepalive}" and output.finished:
                keepalive += 1
                engine.add_request(f"{tag}-busy-{keepalive}", {"prompt": "describe the picture"}, busy)
    engine.abort_request([f"{tag}-busy-{keepalive}"])
    while engine.has_unfinished_requests():
        engine.step()
    return [done[request_id] for request_id in ids]


def main(spec_path: str, out_path: str) -> bool:
    """Run the spec's engine; whether it was shut down (its distributed state cleaned up)."""
    # importable by the engine's processes: the repository root is on their PYTHONPATH
    from tests.integrations.vllm.vllm_engine_model import count_tower_calls

    spec = json.loads(Path(spec_path).read_text())
    import importlib

    from vllm.config import ECTransferConfig

    vllm: Any = importlib.import_module("vllm")
    LLM, SamplingParams = vllm.LLM, vllm.SamplingParams

    kwargs: dict[str, Any] = dict(
        model=spec["model"],
        enforce_eager=True,
        max_model_len=512,
        dtype=spec.get("dtype", "float32"),
        seed=0,
        limit_mm_per_prompt={"image": 4},
    )
    kwargs.update(spec.get("engine", {}))
    if spec.get("ec") is not None:
        kwargs["ec_transfer_config"] = ECTransferConfig(**spec["ec"])
    out: dict[str, Any] = {}
    # What is tracked now (torch, vLLM and the rest of the imports) lives as long as the
    # process: frozen, vLLM's many gc.collect() calls while the engine starts skip it (each
    # scanned it in about half a second). vLLM's engine shutdown unfreezes it again.
    gc.freeze()
    try:
        llm = LLM(**kwargs)
    except Exception as exc:
        out["start_error"] = f"{type(exc).__name__}: {exc}"
        Path(out_path).write_text(json.dumps(out))
        return False
    llm.apply_model(count_tower_calls)
    # the sleeps below poll files that other processes write (allowed in test_no_sleeps.py)
    pause = spec.get("pause_file")
    if pause:
        Path(pause + ".ready").write_text("up")
        stop = time.monotonic() + 120
        while not os.path.exists(pause) and time.monotonic() < stop:
            time.sleep(0.05)
    transfer_params = spec.get("ec_transfer_params")
    awaited = spec.get("await_params")
    if awaited:  # a producer's ec_transfer_params, written by another engine run
        stop = time.monotonic() + 120
        while not os.path.exists(awaited) and time.monotonic() < stop:
            time.sleep(0.002)
        time.sleep(0.01)
        transfer_params = json.loads(Path(awaited).read_text())
    rounds = spec.get("rounds", [spec.get("prompts", [])])
    round_params = spec.get("round_params")
    barrier = spec.get("barrier_dir")
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0.0)
    results = []
    seconds = []
    for k, prompts in enumerate(rounds):
        if round_params is not None:
            transfer_params = round_params[k]
        inputs = [
            {
                "prompt": p["text"],
                "multi_modal_data": {"image": [image(s, spec.get("image_size", 32)) for s in p["images"]]},
            }
            for p in prompts
        ]
        if barrier:
            Path(barrier, f"{spec['name']}.ready-{k}").write_text("up")
            stop = time.monotonic() + 300
            while not os.path.exists(os.path.join(barrier, f"go-{k}")) and time.monotonic() < stop:
                time.sleep(0.001)
        started = time.perf_counter()
        if transfer_params:
            per = [
                SamplingParams(
                    max_tokens=params.max_tokens,
                    temperature=0.0,
                    extra_args={"ec_transfer_params": transfer_params[i]},
                )
                for i in range(len(prompts))
            ]
            if spec.get("keepalive"):
                outputs = generate_kept_busy(llm, inputs, per, f"round{k}")
            else:
                outputs = llm.generate(inputs, per, use_tqdm=False)
        else:
            outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds.append(time.perf_counter() - started)
        published = spec.get("publish_params")
        if published:  # at once, before the saves are flushed: the consumer races them
            tmp = Path(published + ".tmp")
            tmp.write_text(json.dumps([o.ec_transfer_params for o in outputs]))
            tmp.rename(published)
        results.append(
            [
                {
                    "tokens": list(o.outputs[0].token_ids) if o.outputs else [],
                    "ec_transfer_params": o.ec_transfer_params,
                }
                for o in outputs
            ]
        )
    if barrier:  # the last release: the other engine is done with this one
        Path(barrier, f"{spec['name']}.ready-{len(rounds)}").write_text("up")
        stop = time.monotonic() + 300
        while not os.path.exists(os.path.join(barrier, f"go-{len(rounds)}")) and time.monotonic() < stop:
            time.sleep(0.01)
    out["rounds"] = results
    out["round_seconds"] = seconds
    out["tower_images"] = llm.apply_model(count_tower_calls)[0]
    connector = _connector(llm)
    if connector is not None and hasattr(connector, "totals"):
        if hasattr(connector, "flush_saves"):
            connector.flush_saves(10.0)
        out["worker_totals"] = connector.totals()
    Path(out_path).write_text(json.dumps(out))
    if not hasattr(llm.llm_engine, "engine_core"):
        return False
    llm.llm_engine.engine_core.shutdown()  # (an engine core of its own process: that process ends)
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"  # an in-process core cleaned up


def inspect_models_here() -> None:
    """Inspect a model class in this process. vLLM does it in a fresh Python, so that its
    own process never initialises CUDA: on this CPU build that is one more vLLM import (over
    10 s of CPU) for each engine whose model vLLM has not inspected yet (its answer is cached
    in ``VLLM_CACHE_ROOT``, which the engines of a test module share)."""
    import importlib

    registry: Any = importlib.import_module("vllm.model_executor.models.registry")
    if hasattr(registry, "_run_in_subprocess"):  # (a vLLM without it keeps its own way)
        registry._run_in_subprocess = lambda inspect: inspect()


def serve() -> None:
    """Run engines one after another in this process, vLLM imported once: each line of stdin
    is ``SPEC.json OUT.json``; ``done`` on stdout after each. A spec's ``env`` applies to its
    run only (``VLLM_ENABLE_V1_MULTIPROCESSING=1``: this process is the engine's front end)."""
    import importlib

    replies = os.fdopen(os.dup(1), "w")  # vLLM logs to stdout: the replies get a copy of it
    os.dup2(2, 1)
    from vllm.distributed.ec_transfer import ensure_ec_transfer_shutdown

    cleanup_dist_env_and_memory = importlib.import_module(
        "vllm.distributed.parallel_state"
    ).cleanup_dist_env_and_memory
    inspect_models_here()

    for line in sys.stdin:
        spec_path, out_path = line.split()
        spec = json.loads(Path(spec_path).read_text())
        saved = {k: os.environ.get(k) for k in spec.get("env", {})}
        os.environ.update(spec.get("env", {}))
        shut_down = False
        try:
            shut_down = main(spec_path, out_path)
        except BaseException as exc:  # the caller finds no results and reads the log
            print(f"engine run failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        finally:
            ensure_ec_transfer_shutdown()
            if not shut_down:  # (an engine's shutdown has done this: a second full scan of the heap)
                cleanup_dist_env_and_memory()  # unfreezes the heap and collects the engine's garbage
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        print("done", file=replies, flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(sys.argv[1], sys.argv[2])
