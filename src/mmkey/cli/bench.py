"""``mmkey bench``: a quick run of the hashing benchmark (``benchmarks/bench_hash.py``
is the full one; both measure with `mmkey._hashbench`)."""

from __future__ import annotations

import click

__all__ = ["bench"]


@click.command()
@click.option(
    "--dtype",
    "dtypes",
    multiple=True,
    type=click.Choice(["float32", "bfloat16"]),
    default=("float32",),
    show_default=True,
    help="Repeat to measure several dtypes.",
)
@click.option(
    "--repeats",
    type=click.IntRange(1, 50),
    default=3,
    show_default=True,
    help="Timed calls per path; the best is kept.",
)
def bench(dtypes: tuple[str, ...], repeats: int) -> None:
    """Hashing throughput of mmkey's schemes against memory read bandwidth.

    Hashes a Qwen2-VL-sized ``pixel_values`` tensor (9216 x 1176, 43 MB in float32)
    with BLAKE3, XXH3 and SGLANG, next to ``tensor.sum()`` (the rate memory can be
    read at) and the SGLang and vLLM-style algorithms it replaces.
    """
    import platform

    import torch
    from rich.console import Console
    from rich.table import Table

    from mmkey._hashbench import hash_rows

    console = Console()
    with console.status("hashing..."):
        rows = hash_rows(dtypes, repeats=repeats)
    table = Table(
        title=f"Hashing 9216 x 1176 features, best of {repeats} "
        f"(torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()})"
    )
    table.add_column("path")
    table.add_column("dtype")
    table.add_column("GB/s", justify="right")
    table.add_column("x read bandwidth", justify="right")
    table.add_column("x SGLang CPU", justify="right")
    for row in rows:
        table.add_row(
            row.path,
            row.dtype,
            f"{row.gb_per_s:.2f}",
            f"{row.vs_read_bandwidth:.2f}",
            f"{row.vs_sglang_cpu:.1f}",
        )
    console.print(table)
