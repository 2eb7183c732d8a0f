"""An import stand-in for ``sgl_kernel``, SGLang's CUDA kernel package, where the real one can't load.

SGLang 0.5.23 imports ``sgl_kernel`` (the ``sglang-kernel`` wheel) unconditionally on CUDA, in
modules the GPU check needs (``mm_utils``, ``embedding_cache_controller``, the encode server,
the Qwen2-VL model). ``sglang-kernel`` 0.4.10 is built against torch 2.14.1 and its ops library
does not load on another torch, such as a lent GPU machine's 2.11.0. ``scripts/gpu-check.sh``
then writes this file, as ``sgl_kernel/__init__.py`` with the reason beside it, ahead of
everything on ``PYTHONPATH``::

    python scripts/sgl_kernel_standin.py DIR --reason "sglang-kernel 0.4.10 needs torch 2.14.1; ..."

Imported as ``sgl_kernel``, any attribute (``from sgl_kernel import silu_and_mul``) and any
submodule (``sgl_kernel.flash_attn``) resolves, so SGLang's CUDA import path imports. Calling
anything of it raises :class:`KernelUnavailable`, a ``RuntimeError`` naming the kernel and the
reason: nothing is ever computed, so a code path that really needs a kernel fails loudly
instead of passing. ``torch.ops.sgl_kernel`` answers the names of SGLang's CPU kernels
(``<name>_cpu``, which SGLang's CPU engine looks up when a module is imported) with the same
raising stand-ins, and fails at every other lookup as an empty namespace does (SGLang asks
``hasattr`` of CUDA ops before registering their fakes, so those must stay absent).

``python scripts/sgl_kernel_standin.py --probe`` says which ``sgl_kernel`` a run gets: ``real``
and its version when ``import sgl_kernel`` works in a fresh interpreter, else ``stand-in`` and
the reason (the pinned kernel, the torch it needs, the torch here, the import error).
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.metadata
import re
import subprocess
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

NAME = "sgl_kernel"
REASON_FILE = "STANDIN_REASON"
MARKER = "__sgl_kernel_standin__"  # set on the stand-in and its submodules; the real one lacks it


class KernelUnavailable(RuntimeError):
    """A kernel of the ``sgl_kernel`` stand-in was called."""


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


class StandInKernel:
    """A name of the stand-in: its attributes resolve to more names; calling it raises."""

    __slots__ = ("_qualname", "_reason")

    def __init__(self, qualname: str, reason: str) -> None:
        self._qualname = qualname
        self._reason = reason

    def __getattr__(self, attr: str) -> StandInKernel:
        if _is_dunder(attr):  # copy, pickle, inspect and typing probe these; nothing to find
            raise AttributeError(attr)
        return StandInKernel(f"{self._qualname}.{attr}", self._reason)

    def __call__(self, *args: object, **kwargs: object) -> NoReturn:
        raise KernelUnavailable(
            f"{self._qualname} was called, but sgl_kernel here is an import stand-in that "
            f"computes nothing: {self._reason}"
        )

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._qualname}>"


class StandInModule(types.ModuleType):
    """``sgl_kernel`` or one of its submodules: any attribute is a :class:`StandInKernel`."""

    def __getattr__(self, attr: str) -> StandInKernel:
        if _is_dunder(attr):
            raise AttributeError(attr)
        return StandInKernel(f"{self.__name__}.{attr}", str(getattr(self, MARKER)))


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves every ``sgl_kernel.<anything>`` to a :class:`StandInModule`."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(NAME + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StandInModule(spec.name)
        setattr(module, MARKER, self.reason)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class StandInOps:
    """``torch.ops.sgl_kernel``: a ``<name>_cpu`` op is a :class:`StandInKernel`, any other name
    is looked up in torch's own (empty) namespace, and so is missing."""

    def __init__(self, real: object, reason: str) -> None:
        self._real = real
        self._reason = reason

    def __getattr__(self, attr: str) -> object:
        if attr.endswith("_cpu") and not _is_dunder(attr):
            return StandInKernel(f"torch.ops.{NAME}.{attr}", self._reason)
        return getattr(self._real, attr)


def _answer_cpu_ops(reason: str) -> None:
    """Put :class:`StandInOps` at ``torch.ops.sgl_kernel``, where torch is imported (SGLang
    imports it before ``sgl_kernel``)."""
    torch = sys.modules.get("torch")
    ops = getattr(torch, "ops", None)
    if ops is None or isinstance(ops.__dict__.get(NAME), StandInOps):
        return
    setattr(ops, NAME, StandInOps(getattr(ops, NAME), reason))


def _become_stand_in(module: types.ModuleType) -> None:
    """Put a bare stand-in in ``sys.modules`` in place of the module importing this file as
    ``sgl_kernel`` (the import system hands out what ``sys.modules`` holds once the file ran),
    so that none of this file's own names shadow a kernel's."""
    here = Path(module.__file__ or ".").parent
    reason_file = here / REASON_FILE
    reason = reason_file.read_text().strip() if reason_file.exists() else "no reason recorded"
    stand_in = StandInModule(NAME, "An import stand-in for sgl_kernel: " + reason)
    stand_in.__file__ = module.__file__
    stand_in.__spec__ = module.__spec__
    stand_in.__path__ = []
    setattr(stand_in, MARKER, reason)
    sys.modules[NAME] = stand_in
    if not any(isinstance(finder, _SubmoduleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SubmoduleFinder(reason))
    _answer_cpu_ops(reason)


def write(directory: Path, reason: str) -> Path:
    """Write the stand-in package ``directory/sgl_kernel``; put ``directory`` on the path."""
    package = directory / NAME
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(Path(__file__).read_text())
    (package / REASON_FILE).write_text(reason.strip() + "\n")
    return package


def _pin(requirements: Sequence[str] | None, name: str) -> str | None:
    for requirement in requirements or ():
        if ";" in requirement:  # extras and markers: not an install-time pin
            continue
        found = re.fullmatch(rf"{re.escape(name)}\s*==\s*([^\s,]+)", requirement.strip(), re.IGNORECASE)
        if found:
            return found.group(1)
    return None


def _requires(distribution: str) -> list[str] | None:
    try:
        return importlib.metadata.requires(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def reason(import_error: str, torch: str | None = None) -> str:
    """Why the real kernel can't be used here, in one line (for the summary and every call)."""
    installed = _version("sglang-kernel")
    kernel = installed or _pin(_requires("sglang"), "sglang-kernel") or "(no pin found)"
    wants_torch = _pin(_requires("sglang-kernel"), "torch") or _pin(_requires("sglang"), "torch")
    needs = f" needs torch {wants_torch}" if wants_torch else ""
    torch = torch or _version("torch") or "no torch"
    missing = "" if installed else "sglang-kernel is not installed: "
    error = f"{missing}import sgl_kernel: {import_error}"
    return f"sglang-kernel {kernel}{needs}; this machine has {torch} ({error})"


def _import_error(stderr: str) -> str:
    """The gist of a failed ``import sgl_kernel``: the real kernel's loader lists the error of
    each ops library it tried as ``- SomeError: ...`` lines; else the exception's last line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    details = [line[2:] for line in lines if re.match(r"- \w+(Error|Exception): ", line)]
    return "; ".join(details) if details else (lines[-1] if lines else "failed, with no message")


def probe(python: str) -> tuple[str, str]:
    """``("real", version)`` where ``python -c 'import sgl_kernel'`` works, else
    ``("stand-in", reason)``. A fresh interpreter: a failed ops library must not linger here."""
    code = (
        "import sys\n"
        "try:\n"
        "    import torch\n"
        "    print(torch.__version__, flush=True)\n"
        "except ImportError:\n"
        "    print('no-torch', flush=True)\n"
        f"import {NAME}\n"
        f"sys.exit(3 if hasattr({NAME}, {MARKER!r}) else 0)\n"
    )
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    printed = done.stdout.split()
    torch = None if not printed else "no torch" if printed[0] == "no-torch" else printed[0]
    if done.returncode == 0:
        return "real", _version("sglang-kernel") or "(of unknown version)"
    if done.returncode == 3:
        return "stand-in", "a stand-in is already first on the path"
    return "stand-in", reason(_import_error(done.stderr)[:400], torch)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", nargs="?", type=Path, help="write DIRECTORY/sgl_kernel")
    parser.add_argument("--reason", help="why the real kernel is not used (with DIRECTORY)")
    parser.add_argument(
        "--probe",
        action="store_true",
        help="print 'real VERSION' or 'stand-in REASON' for this interpreter",
    )
    args = parser.parse_args(argv)
    if args.probe:
        kind, detail = probe(sys.executable)
        print(f"{kind} {detail}")
        return 0
    if args.directory is None or not args.reason:
        parser.error("give DIRECTORY and --reason, or --probe")
    print(write(args.directory, args.reason))
    return 0


if __name__ == NAME:
    _become_stand_in(sys.modules[__name__])
elif __name__ == "__main__":
    sys.exit(main())
