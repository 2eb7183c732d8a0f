"""A stand-in for SGLang's encode server launcher (run as a program by test_sglang_plugin.py).

It does what SGLang's launcher does before its encoder starts: SGLang's plugin loader, then
the encoder modules, then one child process per label given on the command line, each
started with the function that the spawning module holds under that name now, as SGLang
starts its TP ranks and DP workers (a child whose label is prefixed ``no-namespace:`` unsets
``MMKEY_NAMESPACE`` first thing, one prefixed ``namespace=NAME:`` sets it to NAME).
multiprocessing runs this file again in each child (as ``__mp_main__``) before the target is
unpickled; there SGLang's entry points become `probe`, which reports what
``EmbeddingStoreFactory`` creates for ``mooncake`` instead of starting a GPU encoder. Prints
one JSON object: the parent's targets and the children's reports.

Options: ``--launcher`` reports what ``mooncake`` creates in the launcher too (after the
children started, so they inherit the environment the launcher was given);
``--sglang-version=V`` sets ``sglang.__version__`` to V before the plugins load, in the
launcher only: an SGLang outside the tested range without installing one.

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
NAMESPACE = "namespace="
"""A label prefix ``namespace=NAME:``: that child sets MMKEY_NAMESPACE=NAME first thing."""
ENTRY_KEY = "MMKEY_ENTRY_KEY"
"""The fleet's MAC secret; each report says whether it was set when the store was created."""
MMKEY_MODULE = "mmkey.integrations.sglang"


def qualified(value: Any) -> str:
    return f"{value.__module__}.{value.__qualname__}"


def probe(reports: Any, label: str, *rest: object) -> None:
    """In a child, in place of SGLang's entry point: what `backend` finds there."""
    reports.put({"label": label, "args": len(rest), **backend()})


def backend() -> dict[str, object]:
    """Which class ``mooncake`` maps to in this process, and what `create` makes of it when
    that is mmkey's, or when the switch opts in (mmkey's guard must then refuse SGLang's)."""
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory

    entry = EmbeddingStoreFactory._registry["mooncake"]
    report: dict[str, object] = {
        "mooncake": f"{entry['module_path']}.{entry['class_name']}",
        "entry_key_set": ENTRY_KEY in os.environ,
    }
    opted_in = os.environ.get("MMKEY_SGLANG_BACKEND", "") not in ("", "0")
    if entry["module_path"] == MMKEY_MODULE or opted_in:
        report.update(create())
    return report


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


def load_plugins(version: str | None) -> None:
    """SGLang's plugin loader, as its launcher runs it; with `version` as SGLang's version."""
    import sglang
    import sglang.srt.plugins as plugins

    if version is not None:
        sglang.__version__ = version
    plugins.load_plugins()


def target_of(label: str) -> tuple[str, str]:
    """The module and function a label names, without its prefix."""
    return TARGETS[label.rpartition(":")[2]]


def main(args: list[str]) -> int:
    options = {arg.partition("=")[0]: arg.partition("=")[2] for arg in args if arg.startswith("--")}
    labels = [arg for arg in args if not arg.startswith("--")]
    load_plugins(options.get("--sglang-version"))  # before the encoder modules, as in SGLang's launcher
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # in place of the default, which imports __main__
    reports: Any = context.Queue()
    targets: dict[str, str] = {}
    children = []
    for label in labels:
        module, name = target_of(label)
        target = getattr(importlib.import_module(module), name)
        targets[label] = qualified(target)
        child = context.Process(
            target=target, args=(reports, label, "schedule-path", 1), name=label, daemon=True
        )
        child.start()
        children.append(child)
    launcher = backend() if "--launcher" in options else None
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
    exitcodes = [c.exitcode for c in children]
    print(json.dumps({"targets": targets, "reports": received, "exitcodes": exitcodes, "launcher": launcher}))
    return 0 if len(received) == len(children) else 1


if __name__ == "__mp_main__":  # a spawned child, before its target is unpickled
    _label = multiprocessing.current_process().name
    if _label.startswith(NO_NAMESPACE):
        del os.environ["MMKEY_NAMESPACE"]  # as if started without it: a configuration error
    elif _label.startswith(NAMESPACE):
        os.environ["MMKEY_NAMESPACE"] = _label.removeprefix(NAMESPACE).partition(":")[0]
    vars(importlib.import_module(SERVER))["launch_encoder"] = probe
    vars(importlib.import_module(RUNTIME))["launch_dp_worker"] = probe

if __name__ == "__main__":
    sys.exit(finder_ahead() if sys.argv[1:] == ["--finder-ahead"] else main(sys.argv[1:]))
