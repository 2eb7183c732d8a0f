"""A stand-in for SGLang's encode server launcher (run as a program by test_sglang_plugin.py).

It does what SGLang's launcher does before its encoder starts: SGLang's plugin loader, then
the encoder modules, then one child process per label given on the command line, each
started with the function that the spawning module holds under that name now, as SGLang
starts its TP ranks and DP workers (a child whose label is prefixed ``no-namespace:`` unsets
``MMKEY_NAMESPACE`` first thing). multiprocessing runs this file again in each child (as
``__mp_main__``) before the target is unpickled; there SGLang's entry points become `probe`,
which reports what ``EmbeddingStoreFactory`` creates for ``mooncake`` instead of starting a
GPU encoder. Prints one JSON object: the parent's targets and the children's reports.

The children start from a fork server that has imported the third-party packages SGLang's
encoder imports (`PRELOAD`: torch, transformers and the like, about 4 s of each child's 6 s of
CPU), but neither SGLang nor mmkey: as under ``spawn``, each child imports those itself, runs
this file as ``__mp_main__`` and then unpickles its target by reference.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import multiprocessing
import os
import queue
import sys
from typing import Any

SERVER = "sglang.srt.disaggregation.encoder.server"
RUNTIME = "sglang.srt.disaggregation.encoder.runtime"
GRPC = "sglang.srt.disaggregation.encoder.grpc_server"
TARGETS = {
    "runtime.launch_encoder": (RUNTIME, "launch_encoder"),
    "grpc_server.launch_encoder": (GRPC, "launch_encoder"),
    "runtime.launch_dp_worker": (RUNTIME, "launch_dp_worker"),
    "server.launch_encoder": (SERVER, "launch_encoder"),  # SGLang's own, where it is defined
}
PRELOAD = ["torch", "torchvision", "transformers.modeling_utils", "sympy", "networkx", "openai", "fastapi"]
"""What the fork server imports once for every child; never sglang, mmkey or ``__main__``."""
REPORT_TIMEOUT = 180.0
NO_NAMESPACE = "no-namespace:"
"""A label prefix: that child unsets MMKEY_NAMESPACE before anything reads it."""
MMKEY_MODULE = "mmkey.integrations.sglang"


def qualified(value: Any) -> str:
    return f"{value.__module__}.{value.__qualname__}"


def probe(reports: Any, label: str, *rest: object) -> None:
    """In a child, in place of SGLang's entry point: which class ``mooncake`` maps to, and
    (when that is mmkey's) the store ``create_backend`` builds."""
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory

    entry = EmbeddingStoreFactory._registry["mooncake"]
    report: dict[str, object] = {
        "label": label,
        "args": len(rest),
        "mooncake": f"{entry['module_path']}.{entry['class_name']}",
    }
    if entry["module_path"] == MMKEY_MODULE:
        report.update(create())
    reports.put(report)


def create() -> dict[str, object]:
    """What ``create_backend("mooncake")`` does here, as the encoder calls it: the store it
    created, or the error it refused to start with."""
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory

    try:
        store: Any = EmbeddingStoreFactory.create_backend("mooncake")
    except Exception as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"}
    try:
        return {"created": qualified(type(store)), "namespace": store.namespace}
    finally:
        store.close()


class Bypass(importlib.abc.MetaPathFinder):
    """A finder placed ahead of mmkey's (as import instrumentation or a PEX would be) that
    finds SGLang's encoder modules itself."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in (RUNTIME, GRPC):
            return None
        return importlib.machinery.PathFinder.find_spec(fullname, path, target)

    def __repr__(self) -> str:
        return "Bypass()"


def finder_ahead() -> int:
    """A launcher in which a finder ahead of mmkey's loads the spawning module: its store."""
    import sglang.srt.plugins as plugins

    plugins.load_plugins()
    sys.meta_path.insert(0, Bypass())
    importlib.import_module(RUNTIME)
    print(json.dumps({"launcher": create()}))
    return 0


def main(labels: list[str]) -> int:
    import sglang.srt.plugins as plugins

    plugins.load_plugins()  # before the encoder modules are imported, as in SGLang's launcher
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # in place of the default, which imports __main__
    reports: Any = context.Queue()
    targets: dict[str, str] = {}
    children = []
    for label in labels:
        module, name = TARGETS[label.removeprefix(NO_NAMESPACE)]
        target = getattr(importlib.import_module(module), name)
        targets[label] = qualified(target)
        child = context.Process(
            target=target, args=(reports, label, "schedule-path", 1), name=label, daemon=True
        )
        child.start()
        children.append(child)
    received: list[object] = []
    try:
        for _ in children:
            received.append(reports.get(timeout=REPORT_TIMEOUT))
    except queue.Empty:
        pass
    finally:
        for child in children:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
                child.join()
    print(json.dumps({"targets": targets, "reports": received, "exitcodes": [c.exitcode for c in children]}))
    return 0 if len(received) == len(children) else 1


if __name__ == "__mp_main__":  # a spawned child, before its target is unpickled
    if multiprocessing.current_process().name.startswith(NO_NAMESPACE):
        del os.environ["MMKEY_NAMESPACE"]  # as if started without it: a configuration error
    vars(importlib.import_module(SERVER))["launch_encoder"] = probe
    vars(importlib.import_module(RUNTIME))["launch_dp_worker"] = probe

if __name__ == "__main__":
    sys.exit(finder_ahead() if sys.argv[1:] == ["--finder-ahead"] else main(sys.argv[1:]))
