"""The README stays short and its links resolve; the docs' speed plots parse the benchmarks'
own output."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def _plotter() -> ModuleType:
    spec = importlib.util.spec_from_file_location("plot_benchmarks", DOCS / "plot_benchmarks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("plot_benchmarks", module)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_at_most_8_kib() -> None:
    assert len(README.read_bytes()) <= 8 * 1024


def test_every_relative_link_of_the_readme_names_a_file() -> None:
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links into docs/"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert missing == []


def test_every_docs_page_is_in_a_table_of_contents() -> None:
    index = (DOCS / "index.md").read_text()
    pages = sorted(p.stem for p in DOCS.glob("*.md") if p.stem != "index")
    assert [page for page in pages if f"\n{page}\n" not in index] == []


FIXED_WIDTH = """\
codec (GB/s; ratio = codec / plain)
   entry |  tobytes   encode  ratio | decode target
  64 KiB |     9.87     2.30   0.23 |   5.46    met
1024 KiB |    10.25     5.79   0.57 |   9.38 missed
key to_key(): 28 ns/key
"""

MARKDOWN = """\
| operation | theirs | ours | ours / theirs | note |
|---|---|---|---|---|
| save 64 | 701.07 ms | 605.81 ms | 0.86x | fast |
| load 64 | 283.02 ms | 358.65 ms | 1.27x | verified |
"""


def test_fixed_width_tables_parse_into_named_columns() -> None:
    [table] = _plotter().parse_tables(FIXED_WIDTH)
    assert table.title == "codec (GB/s; ratio = codec / plain)"
    assert table.columns == ("tobytes", "encode", "ratio", "decode")
    assert table.rows == (
        ("64 KiB", ("9.87", "2.30", "0.23", "5.46")),
        ("1024 KiB", ("10.25", "5.79", "0.57", "9.38")),
    )
    assert table.value_columns() == [0, 1, 3]


def test_markdown_tables_keep_their_numeric_columns() -> None:
    [table] = _plotter().parse_tables(MARKDOWN)
    assert table.columns == ("theirs", "ours", "ours / theirs")
    assert table.rows[1] == ("load 64", ("283.02", "358.65", "1.27x"))
    assert table.value_columns() == [0, 1]


@pytest.mark.parametrize("output", sorted((DOCS / "benchmarks").glob("*.txt")), ids=lambda p: p.stem)
def test_every_recorded_benchmark_output_has_a_table_to_plot(output: Path, tmp_path: Path) -> None:
    plotter = _plotter()
    tables = plotter.parse_tables(output.read_text())
    assert tables
    plotter.plot_table(tables[0], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")


SERVING = """\
50% of requests repeat an image:

| configuration | requests/s | TTFT p50 ms | p90 ms | p99 ms | tower runs |
|---|---|---|---|---|---|
| none, 1 clients | 4.2 | 234.7 | 276.3 | 285.4 | 96 |
| mmkey, 16 clients | 8.2 | 1622.3 | 2972.9 | 3715.6 | 48 |

the store's holder paused (SIGSTOP):

| configuration | requests/s | TTFT p50 ms | p90 ms | p99 ms | tower runs |
|---|---|---|---|---|---|
| mmkey, store paused, 16 clients | 6.6 | 1755.7 | 3892.5 | 4773.4 | 50 |
"""


def test_serving_tables_parse_into_latency_by_concurrency(tmp_path: Path) -> None:
    plotter = _plotter()
    cells = plotter.serving_cells(SERVING)
    assert [(c.section, c.row, c.clients, c.p50, c.p99) for c in cells] == [
        ("50% reuse", "none", 1, 234.7, 285.4),
        ("50% reuse", "mmkey", 16, 1622.3, 3715.6),
        ("holder paused", "mmkey, store paused", 16, 1755.7, 4773.4),
    ]
    assert plotter.serving_cells(MARKDOWN) == []


SERVING_RUNS = sorted((DOCS / "benchmarks").glob("bench_serve*.txt"))


@pytest.mark.parametrize("output", SERVING_RUNS, ids=lambda p: p.stem)
def test_each_recorded_serving_run_is_drawn_and_shown(output: Path, tmp_path: Path) -> None:
    plotter = _plotter()
    cells = plotter.serving_cells(output.read_text())
    assert {c.section for c in cells} == {"50% reuse", "80% reuse", "holder paused"}
    plotter.plot_serving(cells, tmp_path / "latency.png", "ms")
    assert (tmp_path / "latency.png").read_bytes().startswith(b"\x89PNG")
    assert f"_generated/{output.stem}-latency.png" in (DOCS / "benchmarks.md").read_text()
