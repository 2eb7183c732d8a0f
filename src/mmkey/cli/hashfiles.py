"""``mmkey hash``: digests and keys of tensors saved with torch or numpy.

A file may hold one tensor or a (nested) dict or list of them. A dict with
``pixel_values`` and ``image_grid_thw`` (or ``pixel_values_videos`` and
``video_grid_thw``), as a Qwen2-VL processor returns, also gets one line per item:
the digest and key `encode_with_cache` uses for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import click

from mmkey.cli._common import BAD_INPUT, modality_option_type, scheme_option_type, warn
from mmkey.digest import HashScheme, MMHash, Modality

if TYPE_CHECKING:
    import torch

__all__ = ["Hashed", "hash_file", "hash_files", "load_tensors"]

_ITEM_PAIRS = (
    ("pixel_values", "image_grid_thw", Modality.IMAGE),
    ("pixel_values_videos", "video_grid_thw", Modality.VIDEO),
)


@attrs.frozen(slots=True)
class Hashed:
    """One digest: what was hashed (a tensor, or an item of a request) and how."""

    name: str
    description: str
    modality: Modality | None
    digest: MMHash


def load_tensors(path: Path) -> object:
    """The object saved in `path`: ``.npy``/``.npz`` with numpy, anything else with
    ``torch.load(weights_only=True)`` (no arbitrary code runs)."""
    import torch

    if path.suffix in (".npy", ".npz"):
        try:
            import numpy
        except ImportError:
            raise ValueError("reading .npy/.npz files needs numpy: pip install numpy") from None
        loaded = numpy.load(path, allow_pickle=False)
        if path.suffix == ".npz":
            with loaded:
                return {name: torch.from_numpy(loaded[name]) for name in loaded.files}
        return torch.from_numpy(loaded)
    return torch.load(path, map_location="cpu", weights_only=True)


def _walk(obj: object, inner: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in `obj`, with its dotted place (``""`` for `obj` itself)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield inner, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _walk(v, f"{inner}.{k}" if inner else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{inner}.{i}" if inner else str(i))


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def hash_file(path: Path, scheme: HashScheme, modality: Modality) -> list[Hashed]:
    """Every tensor of `path` hashed whole, then each item of any processor output in it."""
    from mmkey.encoder import hashes_from_features
    from mmkey.hashing import hash_tensor

    obj = load_tensors(path)
    tensors = list(_walk(obj))
    if not tensors:
        raise ValueError("no tensors in it")
    out = [
        Hashed(f"{path}:{n}" if n else str(path), _describe(t), modality, hash_tensor(t, scheme))
        for n, t in tensors
    ]
    if isinstance(obj, Mapping):
        for features, grids, item_modality in _ITEM_PAIRS:
            if features in obj and grids in obj:
                grid_thw: Any = obj[grids]
                digests = hashes_from_features(obj[features], grid_thw, scheme=scheme)
                rows = grid_thw.tolist() if hasattr(grid_thw, "tolist") else list(grid_thw)
                for i, (digest, grid) in enumerate(zip(digests, rows, strict=True)):
                    out.append(
                        Hashed(
                            f"{path}:{features}#{i}",
                            f"item grid=({grid[0]},{grid[1]},{grid[2]})",
                            item_modality,
                            digest,
                        )
                    )
    return out


def _one_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _line(h: Hashed, scheme: HashScheme, namespace: str | None, as_json: bool) -> str:
    from mmkey.keys import EmbeddingKey

    digest = f"{h.digest:0{scheme.hex_width}x}"
    modality = h.modality or Modality.IMAGE
    key = EmbeddingKey(namespace, modality, scheme, h.digest).to_key() if namespace else None
    if as_json:
        record = {
            "name": h.name,
            "tensor": h.description,
            "scheme": scheme.value,
            "digest": digest,
        }
        if key is not None:
            record["key"] = key
        return json.dumps(record, ensure_ascii=False)
    return f"{key or digest}  {h.name}  {h.description}"


@click.command("hash")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path, dir_okay=False))
@click.option("--namespace", "-n", help="Print cache keys under this namespace, not digests.")
@click.option("--scheme", "-s", type=scheme_option_type, default="blake3", show_default=True)
@click.option(
    "--modality",
    "-m",
    type=modality_option_type,
    default="image",
    show_default=True,
    help="Modality of whole tensors in keys (items of processor outputs know theirs).",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per digest.")
def hash_files(
    files: tuple[Path, ...], namespace: str | None, scheme: str, modality: str, as_json: bool
) -> None:
    """Digests (or keys) of tensors saved with torch.save or numpy.save.

    One line per tensor, ``DIGEST  FILE:NAME  DTYPE[SHAPE]``; with --namespace the key
    replaces the digest. Exit status 2 if any file cannot be read.
    """
    from mmkey.errors import InvalidKey
    from mmkey.keys import EmbeddingKey

    the_scheme = HashScheme(scheme)
    the_modality = Modality(modality)
    if namespace is not None:
        try:
            EmbeddingKey(namespace, the_modality, the_scheme, MMHash(0))
        except InvalidKey as exc:
            warn("hash", f"--namespace: {exc}")
            raise SystemExit(BAD_INPUT) from None
    bad = 0
    for path in files:
        try:
            hashed = hash_file(path, the_scheme, the_modality)
        except OSError as exc:
            warn("hash", f"{path}: cannot read: {exc.strerror or exc}")
            bad += 1
            continue
        except Exception as exc:  # any unreadable file is one line, never a traceback
            warn("hash", f"{path}: not a tensor file saved with torch or numpy ({_one_line(exc)})")
            bad += 1
            continue
        for h in hashed:
            click.echo(_line(h, the_scheme, namespace, as_json))
    if bad:
        raise SystemExit(BAD_INPUT)
