"""Import, with CUDA emulated where there is none, the SGLang modules the GPU check needs.

On CUDA, SGLang takes other import paths than on CPU: ``sgl_kernel`` is imported
unconditionally, and FlashInfer, DeepGEMM, TVM-FFI, ``cuda`` and Triton are tried. On a
machine without a GPU, ``scripts/gpu-check.sh --setup-only`` runs this in a child process so
that a module missing from that path shows up there, not only on a lent GPU machine: before
SGLang is imported, torch is made to report one CUDA device (an H200, capability 9.0, CUDA
13.0). Then it imports exactly what the CUDA-marked tests and ``scripts/sglang_e2e.py``'s
encode servers import (:data:`MODULES`) and prints one line: the modules, which ``sgl_kernel``
was found (real, or the stand-in of ``scripts/sgl_kernel_standin.py``), the accelerator
packages that were tried and found, and those that were tried, not found and tolerated (SGLang
catches their absence). Exit status 0 when every module imported.

    python scripts/sglang_cuda_imports.py             # emulate CUDA unless torch sees a device
    python scripts/sglang_cuda_imports.py --block tvm_ffi  # is tvm_ffi needed? (hard or optional)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import re
import sys
import traceback
import types
from collections.abc import Sequence

#: what the CUDA-marked tests and the encode servers of sglang_e2e.py import
MODULES = (
    "sglang.srt.managers.mm_utils",  # test_sglang_gpu.py: SGLang's GPU feature hash
    "sglang.srt.multimodal.modality",
    "sglang.srt.mem_cache.embedding_cache_controller",  # the pools mmkey's store serves
    "sglang.srt.mem_cache.embedding_store",
    "sglang.launch_server",  # what sglang_e2e.py runs, --encoder-only:
    "sglang.srt.disaggregation.encoder.http_server",
    "sglang.srt.disaggregation.encoder.server",
    "sglang.srt.model_loader",
    "sglang.srt.models.qwen2_vl",  # the tiny model's architecture and its processor
    "sglang.srt.multimodal.processors.qwen_vl",
    "mmkey.integrations.sglang",
    "mmkey.integrations.sglang._hash",
)
#: accelerator packages whose import attempts are reported (top-level names)
ACCELERATOR = frozenset(
    {
        "sgl_kernel",
        "flashinfer",
        "flash_attn",
        "flash_mla",
        "deep_gemm",
        "deep_ep",
        "sgl_deep_ep",
        "tvm_ffi",
        "cuda",
        "triton",
        "cutlass",
        "cuda_python",
        "vllm",
        "aiter",
        "quack",
        "pynvml",
    }
)


class _Recorder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: notes every accelerator package asked for (finds nothing),
    and makes the ``blocked`` ones unimportable."""

    def __init__(self, blocked: frozenset[str]) -> None:
        self.asked: set[str] = set()
        self.blocked = blocked

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top in ACCELERATOR or top in self.blocked:
            self.asked.add(top)
        if top in self.blocked:
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked)", name=fullname)
        return None


def emulate_cuda() -> str:
    """Make torch report one CUDA device where it sees none; what was done, in words."""
    import torch

    if torch.cuda.is_available():
        return f"a real CUDA device ({torch.cuda.get_device_name(0)})"
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    torch.cuda.get_device_name = lambda *args, **kwargs: "NVIDIA H200"
    if torch.version.cuda is None:  # a CPU build of torch
        torch.version.cuda = "13.0"
    return f"CUDA emulated (H200, capability 9.0, CUDA {torch.version.cuda}) on torch {torch.__version__}"


def sgl_kernel_found() -> str:
    module = sys.modules.get("sgl_kernel")
    if module is None:
        return "not imported"
    if hasattr(module, "__sgl_kernel_standin__"):  # its reason: scripts/sgl_kernel_standin.py --probe
        return "stand-in"
    try:
        version = importlib.metadata.version("sglang-kernel")
    except importlib.metadata.PackageNotFoundError:
        version = "of unknown version"
    return f"real {version}"


def where(error: BaseException) -> str:
    """The last SGLang or mmkey frames of a failed import, short."""
    frames = [
        f"{re.sub(r'.*/(?=(sglang|mmkey)/)', '', frame.filename)}:{frame.lineno}"
        for frame in traceback.extract_tb(error.__traceback__)
        if ("sglang" in frame.filename or "mmkey" in frame.filename) and frame.filename != __file__
    ]
    return " <- ".join(reversed(frames[-3:]))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--block", action="append", default=[], help="make this top-level package unimportable"
    )
    parser.add_argument(
        "modules", nargs="*", help=f"modules to import (default: {len(MODULES)} of the GPU check)"
    )
    args = parser.parse_args(argv)
    recorder = _Recorder(frozenset(args.block))
    sys.meta_path.insert(0, recorder)
    device = emulate_cuda()
    failed: list[str] = []
    modules = args.modules or MODULES
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as error:  # noqa: BLE001 - SystemExit and the like count as failures too
            failed.append(f"{name}: {type(error).__name__}: {str(error)[:200]} [{where(error)}]")
    found = sorted(name for name in recorder.asked if name in sys.modules)
    absent_ones = sorted(name for name in recorder.asked - set(found))
    absent = "tried and absent" if failed else "tried, absent and tolerated"
    summary = (
        f"{device}; sgl_kernel {sgl_kernel_found()}; accelerator packages found: "
        f"{', '.join(found) or 'none'}; {absent}: {', '.join(absent_ones) or 'none'}"
    )
    if failed:
        # the first failure is the one to read: later ones often follow from it (a half-imported
        # sglang package)
        others = f" and {len(failed) - 1} more" if len(failed) > 1 else ""
        print(f"gpu-check: CUDA IMPORTS FAIL ({failed[0]}{others}, of {len(modules)} modules; {summary})")
        return 1
    print(f"gpu-check: CUDA IMPORTS OK ({len(modules)} modules; {summary})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
