"""``mmkey key``: decode and explain keys found in logs or in the store."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import click

from mmkey.cli._common import BAD_INPUT, warn
from mmkey.digest import HashScheme
from mmkey.errors import InvalidKey
from mmkey.keys import EmbeddingKey

__all__ = ["explain", "key"]

_SCHEME_NOTES = {
    HashScheme.BLAKE3: "128-bit BLAKE3 over dtype, shape and bytes",
    HashScheme.XXH3: "128-bit XXH3 over dtype, shape and bytes; trusted input only",
    HashScheme.SGLANG: "64-bit SGLang CPU tensor_hash of the raw bytes",
}


def explain(k: EmbeddingKey) -> list[str]:
    """The lines `mmkey key` prints for one key."""
    digest_hex = f"{k.digest:0{k.scheme.hex_width}x}"
    return [
        k.to_key(),
        "  format     v1 (mmk1)",
        f"  namespace  {k.namespace}",
        f"  modality   {k.modality.value}",
        f"  scheme     {k.scheme.value} ({_SCHEME_NOTES[k.scheme]})",
        f"  digest     {digest_hex} (decimal {k.digest})",
    ]


def as_json(k: EmbeddingKey) -> str:
    """One JSON object per key; the digest as text (JSON readers may round big ints)."""
    return json.dumps(
        {
            "key": k.to_key(),
            "format": "mmk1",
            "namespace": k.namespace,
            "modality": k.modality.value,
            "scheme": k.scheme.value,
            "digest": f"{k.digest:0{k.scheme.hex_width}x}",
            "digest_decimal": str(k.digest),
        },
        ensure_ascii=False,
    )


def _texts(keys: tuple[str, ...]) -> Iterator[str]:
    for text in keys:
        if text == "-":
            for line in sys.stdin:
                line = line.rstrip("\r\n")
                if line:
                    yield line
        else:
            yield text


def _hint(text: str) -> str:
    if text.isascii() and text.isdigit():
        return (
            " (this looks like a bare decimal digest: a key is "
            "EmbeddingKey(namespace, modality, scheme, digest).to_key())"
        )
    return ""


@click.command()
@click.argument("keys", nargs=-1, required=True, metavar="KEY...")
@click.option("--json", "as_json_lines", is_flag=True, help="One JSON object per key.")
def key(keys: tuple[str, ...], as_json_lines: bool) -> None:
    """Decode and explain cache keys (``-`` reads one key per line from stdin).

    Exit status 2 if any key is not a valid v1 key; the valid ones are still shown.
    """
    bad = 0
    first = True
    for text in _texts(keys):
        try:
            parsed = EmbeddingKey.from_key(text)
        except InvalidKey as exc:
            warn("key", f"{exc}{_hint(text)}")
            bad += 1
            continue
        if as_json_lines:
            click.echo(as_json(parsed))
        else:
            if not first:
                click.echo()
            click.echo("\n".join(explain(parsed)))
        first = False
    if bad:
        raise SystemExit(BAD_INPUT)
