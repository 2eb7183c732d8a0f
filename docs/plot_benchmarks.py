"""Plot the speed tables that the benchmarks print, for the documentation.

Each ``*.txt`` file in the input folder is the standard output of one run of a benchmark
(``python benchmarks/bench_cache.py > docs/benchmarks/bench_cache.txt``). The tables in it
are found as the benchmarks print them: a header line, then rows of a label followed by
numbers (fixed-width columns, ``|`` separators allowed), or Markdown tables. Every table
becomes one PNG in the output folder, ``<file stem>-<n>.png``: a horizontal bar chart of its
value columns per row (the ratio columns, numbers ending in ``x``, are printed as labels
instead). Run it by hand with ``python docs/plot_benchmarks.py IN_DIR OUT_DIR``; the docs
build runs it on every build.
"""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import attrs

NUMBER = re.compile(r"-?\d+(?:\.\d+)?x?")
_TRAILING_NUMBERS = re.compile(
    r"^(?P<label>.*?\S)?(?P<numbers>(?:\s+-?\d+(?:\.\d+)?x?)+)(?:\s+[A-Za-z]+)?\s*$"
)
_RATIO_NAME = re.compile(r"ratio|cost|speed-?up|^x ")


@attrs.frozen
class Table:
    """One printed table: its title, its column names and its rows of numbers."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, tuple[str, ...]], ...]

    def value_columns(self) -> list[int]:
        """Indices of the columns holding measurements (not ratios: a name such as ``ratio``
        or ``x SGLang``, or numbers ending in ``x``)."""
        return [
            i
            for i, name in enumerate(self.columns)
            if not _RATIO_NAME.search(name) and not any(cells[i].endswith("x") for _, cells in self.rows)
        ]

    def ratio_columns(self) -> list[int]:
        """Indices of the ratio columns (every value ends in ``x``)."""
        return [i for i in range(len(self.columns)) if i not in self.value_columns()]


def _numeric_row(line: str) -> tuple[str, list[tuple[int, int, str]]] | None:
    """``(label, [(start, end, number)])`` of a fixed-width row, or None if it is not one."""
    plain = line.replace("|", " ").rstrip()
    segments = re.split(r"(\s{2,})", plain)
    if len(segments) > 2 and not re.match(r"-?\d", segments[-1]):
        plain = "".join(segments[:-2])  # a note after the numbers ("target <= 1.5x", "met")
    match = _TRAILING_NUMBERS.match(plain)
    if match is None or not match.group("label"):
        return None
    numbers = plain[: match.end("numbers")]
    spans = [(m.start(), m.end(), m.group()) for m in NUMBER.finditer(numbers, match.start("numbers"))]
    return re.sub(r"\s+", " ", match.group("label").strip()), spans


def _column_names(header: str, spans: Sequence[tuple[int, int, str]]) -> tuple[str, ...]:
    """The header words above each column: names and numbers are right-aligned alike."""
    names = []
    for index, (_, end, _) in enumerate(spans):
        if index:
            cell = header[spans[index - 1][1] : end]
        else:
            cell = re.split(r"\s{2,}", header[:end].replace("|", " ").rstrip())[-1]
        names.append(cell.replace("|", " ").strip() or f"column {index + 1}")
    return tuple(names)


def _title(header: str, spans: Sequence[tuple[int, int, str]], first: str) -> str:
    """The header's text left of its first column name."""
    cut = header[: spans[0][1]].rstrip()
    title = cut[: len(cut) - len(first)] if cut.endswith(first) else header
    return re.sub(r"\s+", " ", title.replace("|", " ")).strip() or "table"


def _fixed_width_tables(lines: Sequence[str]) -> list[Table]:
    tables: list[Table] = []
    index = 0
    while index < len(lines):
        header = lines[index]
        first = _numeric_row(lines[index + 1]) if index + 1 < len(lines) else None
        if (
            not header.strip()
            or _numeric_row(header) is not None
            or first is None
            or header.lstrip().startswith("|")
        ):
            index += 1
            continue
        columns = _column_names(header, first[1])
        caption = lines[index - 1].strip() if index else ""
        title = caption if caption and _numeric_row(caption) is None else _title(header, first[1], columns[0])
        rows: list[tuple[str, tuple[str, ...]]] = []
        index += 1
        while index < len(lines):
            row = _numeric_row(lines[index])
            if row is None:
                break
            if len(row[1]) != len(columns):
                # fewer columns further down (totals, rates): a table of its own
                tables.append(Table(title, columns, tuple(rows)))
                columns, rows = columns[: len(row[1])], []
                title = f"{title} (continued)"
            rows.append((row[0], tuple(number for _, _, number in row[1])))
            index += 1
        tables.append(Table(title, columns, tuple(rows)))
    return tables


def _markdown_tables(lines: Sequence[str]) -> list[Table]:
    tables: list[Table] = []
    index = 0
    while index + 1 < len(lines):
        header, rule = lines[index].strip(), lines[index + 1].strip()
        if not (header.startswith("|") and set(rule) <= set("|-: ") and "-" in rule):
            index += 1
            continue
        names = [cell.strip() for cell in header.strip("|").split("|")]
        rows: list[tuple[str, list[str | None]]] = []
        index += 2
        while index < len(lines) and lines[index].strip().startswith("|"):
            cells = [cell.strip() for cell in lines[index].strip().strip("|").split("|")]
            numbers: list[str | None] = []
            for cell in cells[1:]:
                found = NUMBER.match(cell.replace("*", ""))
                numbers.append(found.group() if found else None)
            rows.append((cells[0], numbers))
            index += 1
        keep = [
            i
            for i in range(len(names) - 1)
            if rows and all(r[1][i] is not None for r in rows if i < len(r[1]))
        ]
        columns = tuple(names[i + 1] for i in keep)
        tables.append(
            Table(names[0], columns, tuple((label, tuple(str(r[i]) for i in keep)) for label, r in rows))
        )
    return tables


def parse_tables(text: str) -> list[Table]:
    """Every table in a benchmark's printed output, in order."""
    lines = text.splitlines()
    return [t for t in _fixed_width_tables(lines) + _markdown_tables(lines) if len(t.rows) >= 2]


def plot_table(table: Table, path: Path) -> None:
    """Draw ``table`` as grouped horizontal bars into the PNG ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = table.value_columns() or table.ratio_columns()
    ratios = [i for i in table.ratio_columns() if i not in values]
    labels = [label for label, _ in table.rows]
    height = 0.8 / max(1, len(values))
    figure, axes = plt.subplots(figsize=(8, 0.5 + 0.45 * len(labels) * max(1, len(values)) ** 0.5))
    everything: list[float] = []
    for slot, column in enumerate(values):
        numbers = [float(cells[column].rstrip("x")) for _, cells in table.rows]
        everything += numbers
        positions = [row + slot * height for row in range(len(labels))]
        axes.barh(positions, numbers, height=height, label=table.columns[column])
    positive = [n for n in everything if n > 0]
    if positive and max(positive) / min(positive) > 50:
        axes.set_xscale("log")  # rows of very different sizes: each stays readable
    for row, (_, cells) in enumerate(table.rows):
        note = "  ".join(f"{table.columns[i]} {cells[i]}" for i in ratios)
        if note:
            end = max(float(cells[i].rstrip("x")) for i in values)
            axes.annotate(
                note,
                (end, row + (len(values) - 1) * height / 2),
                xytext=(4, 0),
                textcoords="offset points",
                fontsize=7,
                va="center",
            )
    axes.margins(x=0.15)
    axes.set_yticks([row + (len(values) - 1) * height / 2 for row in range(len(labels))], labels, fontsize=8)
    axes.invert_yaxis()
    axes.set_title(textwrap.fill(table.title, 100), fontsize=8)
    if len(values) > 1:
        axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


_SHARE = re.compile(r"^(\d+)% of requests repeat an image:")
_PAUSED = re.compile(r"holder paused")
_CELL = re.compile(r"^\| (?P<row>[^|]+?), (?P<clients>\d+) clients \|(?P<cells>.*)\|$")


@attrs.frozen
class ServingCell:
    """One row of a serving benchmark's tables: latency percentiles at one concurrency."""

    section: str
    """``"50% reuse"``, ``"80% reuse"`` or ``"holder paused"``."""
    row: str
    clients: int
    p50: float
    p99: float


def serving_cells(text: str) -> list[ServingCell]:
    """The cells of a serving benchmark's printout (``bench_serve``, ``bench_serve_sglang``):
    each table's rows of ``"<row>, <n> clients"`` under the heading it follows."""
    found: list[ServingCell] = []
    section = ""
    for line in text.splitlines():
        share = _SHARE.match(line)
        if share:
            section = f"{share.group(1)}% reuse"
        elif _PAUSED.search(line) and line.endswith(":"):
            section = "holder paused"
        cell = _CELL.match(line)
        if cell and section:
            numbers = [c.strip() for c in cell.group("cells").split("|")]
            # requests/s, p50, p90, p99, ...: the table's second to fifth columns
            row, clients = cell.group("row"), int(cell.group("clients"))
            found.append(ServingCell(section, row, clients, float(numbers[1]), float(numbers[3])))
    return found


def plot_serving(cells: Sequence[ServingCell], path: Path, latency: str) -> None:
    """Latency against concurrency, one panel per reuse level: each row's p50 (solid) and p99
    (dashed), the paused-holder run as points, on a log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = [s for s in dict.fromkeys(c.section for c in cells) if s != "holder paused"]
    paused = [c for c in cells if c.section == "holder paused"]
    size = (5 * len(sections), 4)
    figure, panels = plt.subplots(1, len(sections), figsize=size, sharey=True, squeeze=False)
    for axes, section in zip(panels[0], sections, strict=True):
        shown = [c for c in cells if c.section == section]
        for number, row in enumerate(dict.fromkeys(c.row for c in shown)):
            points = sorted((c.clients, c.p50, c.p99) for c in shown if c.row == row)
            colour = f"C{number}"
            axes.plot([p[0] for p in points], [p[1] for p in points], "o-", color=colour, label=f"{row} p50")
            axes.plot([p[0] for p in points], [p[2] for p in points], "s--", color=colour, label=f"{row} p99")
        if section == sections[-1]:
            for c in paused:
                axes.plot([c.clients], [c.p99], "kx", markersize=9, label=f"{c.row} p99")
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        clients = sorted({c.clients for c in shown})
        axes.set_xticks(clients, [str(n) for n in clients])
        axes.set_xlabel("concurrent clients")
        axes.set_title(section, fontsize=9)
        axes.grid(True, which="both", alpha=0.3)
    panels[0][0].set_ylabel(f"{latency} ms")
    panels[0][-1].legend(fontsize=6, loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def plot_all(source: Path, target: Path) -> list[tuple[Path, Table]]:
    """Plot every table of every ``*.txt`` in ``source`` into ``target``, and each serving
    benchmark's latencies (``<stem>-latency.png``); the tables it drew."""
    target.mkdir(parents=True, exist_ok=True)
    drawn = []
    for output in sorted(source.glob("*.txt")):
        text = output.read_text()
        for number, table in enumerate(parse_tables(text), start=1):
            path = target / f"{output.stem}-{number}.png"
            plot_table(table, path)
            drawn.append((path, table))
        serving = serving_cells(text)
        if serving:
            latency = "TTFT" if "TTFT p50" in text else "/encode"
            plot_serving(serving, target / f"{output.stem}-latency.png", latency)
    return drawn


def main(argv: Sequence[str]) -> int:
    """Plot every table of every ``*.txt`` in ``argv[0]`` into ``argv[1]``; print what it drew."""
    for path, table in plot_all(Path(argv[0]), Path(argv[1])):
        print(f"{path.name}: {table.title} ({len(table.rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
