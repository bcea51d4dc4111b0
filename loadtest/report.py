"""What every benchmark ends with, written once: its table, results.json, its figures, and its SLO.

    report = build_report(...)                                  # a plain dict of what was measured
    write_results(args.out, report, lambda: print_table(report),
                  {"bench_x.png": lambda path: plot(report, path)})

writes, into --out: results.json; output.txt, a copy of what the table printed to stdout;
and each figure as a PNG, drawn inside `figure()` (the Agg backend, a light grid on every
axes, one suptitle, tight layout, savefig, close). Tables are fixed-width: a `Table` of
`Column`s (header, width, format spec) formats a header, a rule and one line per row, and
renders the same columns as a Markdown table where a benchmark writes one.

An `Slo` is the latency objective of one request (TTFT under a bound, and optionally the
mean inter-token latency under another) and the rule by which a load is sustained: every
request finished and at least `percentile` percent of them met the SLO. The benchmarks
ask different questions, so each passes its own bounds to this one definition.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TextIO

from loadtest.metrics import RequestTimeline


def log(message: str) -> None:
    """Progress, on stderr, so stdout holds only the table."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


# -- tables ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """One column of a fixed-width table.

    A cell is `f"{value * scale:{spec}}{unit}"` aligned in `width` characters, after `gap`
    spaces; a value that is None or NaN (not measured) is written "-". A value wider than
    its column is written whole, as an f-string would."""

    header: str
    width: int
    spec: str = ""  # a format spec: ".2f", ".0%", "g", "+.2f"; "" writes str(value)
    unit: str = ""  # written right after the number, inside the width: "s", "x"
    align: str = ">"  # ">" right (numbers), "<" left (names)
    scale: float = 1.0  # the value is multiplied first: 1e3 turns seconds into ms
    gap: int = 0  # spaces before the column

    def __post_init__(self) -> None:
        if self.width < 0:
            raise ValueError(f"Column.width must be >= 0, got {self.width} (column {self.header!r})")
        if self.gap < 0:
            raise ValueError(f"Column.gap must be >= 0, got {self.gap} (column {self.header!r})")
        if self.align not in ("<", ">"):
            raise ValueError(f"Column.align must be '<' or '>', got {self.align!r} (column {self.header!r})")
        if not math.isfinite(self.scale) or self.scale == 0:
            raise ValueError(f"Column.scale must be finite and non-zero, got {self.scale} (column {self.header!r})")
        try:
            format(1.0, self.spec)
        except ValueError:
            raise ValueError(f"Column.spec is not a format spec: {self.spec!r} (column {self.header!r})") from None

    def text(self, value: Any) -> str:
        """The cell's text, before alignment."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if self.scale != 1.0:
            value = value * self.scale
        return f"{value:{self.spec}}{self.unit}"

    def cell(self, value: Any) -> str:
        return " " * self.gap + f"{self.text(value):{self.align}{self.width}}"

    def head(self) -> str:
        return " " * self.gap + f"{self.header:{self.align}{self.width}}"


@dataclass(frozen=True)
class Table:
    """Columns side by side with no separator (each column's width and gap set the spacing)."""

    columns: tuple[Column, ...]
    rule: bool = True  # a line of dashes as long as the header, under it

    def __post_init__(self) -> None:
        if not self.columns:
            raise ValueError("Table.columns must name at least one column, got none")

    def header(self) -> str:
        return "".join(c.head() for c in self.columns).rstrip()

    def row(self, values: Sequence[Any]) -> str:
        """One line; fewer values than columns leave the last columns out."""
        if len(values) > len(self.columns):
            raise ValueError(f"Table.row got {len(values)} values for {len(self.columns)} columns: {list(values)}")
        return "".join(c.cell(v) for c, v in zip(self.columns, values)).rstrip()

    def lines(self, rows: Sequence[Sequence[Any]]) -> list[str]:
        head = self.header()
        return [head, *(["-" * len(head)] if self.rule else []), *(self.row(r) for r in rows)]

    def markdown(self, rows: Sequence[Sequence[Any]]) -> list[str]:
        """The same columns as a Markdown table: each cell's text unpadded."""
        lines = ["| " + " | ".join(c.header for c in self.columns) + " |", "|" + "---|" * len(self.columns)]
        for values in rows:
            if len(values) != len(self.columns):
                raise ValueError(f"Table.markdown got {len(values)} values for {len(self.columns)} columns")
            lines.append("| " + " | ".join(c.text(v) for c, v in zip(self.columns, values)) + " |")
        return lines


# -- what a benchmark writes ---------------------------------------------------------------------


class _Tee(io.TextIOBase):
    """Writes go to the real stdout and are kept."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        self.stream.write(text)
        return self.kept.write(text)

    def flush(self) -> None:
        self.stream.flush()


@contextlib.contextmanager
def printed_to(path: Path) -> Iterator[None]:
    """What is printed to stdout inside the block still reaches stdout, and is written to path."""
    tee = _Tee(sys.stdout)
    try:
        with contextlib.redirect_stdout(tee):
            yield
    finally:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(tee.kept.getvalue())


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"results.json cannot hold a {type(value).__name__}: {value!r}")


def write_json(path: Path, data: Mapping[str, Any]) -> Path:
    """data as indented JSON (paths as strings; NaN and inf as Python's json writes them)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    return path


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def figure(
    path: Path, nrows: int = 1, ncols: int = 1, *, title: str | None = None, dpi: int = 110, **subplots: Any
) -> Iterator[tuple[Any, Any]]:
    """(fig, axes) from plt.subplots(nrows, ncols, **subplots); on leaving the block every axes
    gets a light grid, the figure its title and a tight layout, and it is saved to path as PNG
    and closed. An exception inside the block saves nothing."""
    plt = pyplot()
    fig, axes = plt.subplots(nrows, ncols, **subplots)
    try:
        yield fig, axes
        for ax in fig.axes:
            ax.grid(True, which="both", alpha=0.3)
        if title is not None:
            fig.suptitle(title)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def write_results(
    out: Path,
    results: Mapping[str, Any],
    print_table: Callable[[], None],
    figures: Mapping[str, Callable[[Path], None]],
    text_name: str = "output.txt",
) -> list[Path]:
    """The tail of every benchmark: results.json, the table printed (and kept as text_name),
    then each figure drawn to out/name; logs and returns the paths written."""
    written = [write_json(out / "results.json", results)]
    with printed_to(out / text_name):
        print_table()
    written.append(out / text_name)
    for name, draw in figures.items():
        draw(out / name)
        written.append(out / name)
    log(f"wrote {', '.join(p.name for p in written)} into {out}")
    return written


# -- the SLO --------------------------------------------------------------------------------------


class RequestLatency(NamedTuple):
    """What an SLO judges of one request."""

    ttft_s: float  # inf when no token came
    mean_itl_s: float | None  # (last token - first token) / gaps; None with fewer than two tokens
    finished: bool  # every token it asked for arrived

    @classmethod
    def of(cls, timeline: RequestTimeline, finished: bool = True) -> RequestLatency:
        times = timeline.token_times
        if not times:
            return cls(math.inf, None, False)
        mean_itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        return cls(timeline.ttft, mean_itl, finished)


@dataclass(frozen=True)
class Slo:
    """A per-request latency objective, and when a load counts as sustained.

    A request meets the SLO when it finished, its TTFT is under `ttft_s` and (if
    `mean_itl_s` is set) its mean ITL is under `mean_itl_s`; a request with one token has
    no gap to judge. A load is sustained when every request finished and at least
    `percentile` percent of them met the SLO: percentile 99 reads "p99 TTFT under the
    bound", 50 "half of them within it".

    Each benchmark asks its own question, so each passes its own bounds:
      bench_engine    TTFT < 1 s at p99: the seed chapter's interactive target on `tiny`,
                      whose prefills take milliseconds; the sweep's highest sustained rate.
      bench_prefix    TTFT < 1.5 x the cold TTFT measured at the start of the run (one miss
                      on an idle cluster; --slo-factor, or --ttft-slo in seconds), half of the
                      requests: a miss that does not queue meets it, one behind another miss
                      does not, a hit meets it with room to spare (a fixed 5 s failed every
                      miss in an hour when prefill took 4.8-5.3 s); a configuration that
                      keeps half of them there still runs.
      bench_policies  TTFT < 2 s and mean ITL < 200 ms, per request, for goodput (requests
                      meeting it / makespan): the mixed workload's 1,024-token documents on
                      CPU workers; the bounds are loadtest.policy_replay's, which judges the
                      real runs with them (its meets_slo is this meets, checked by a test).
    loadtest.sim.run judges its simulated clusters by TTFT < 1 s and mean ITL < 100 ms with a
    copy of meets of its own: Slo(ttft_s=1.0, mean_itl_s=0.1) when it adopts this one.
    """

    ttft_s: float
    mean_itl_s: float | None = None
    percentile: float = 99.0

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and math.isfinite(self.ttft_s)):
            raise ValueError(f"Slo.ttft_s must be positive and finite, got {self.ttft_s}")
        if self.mean_itl_s is not None and not (self.mean_itl_s > 0 and math.isfinite(self.mean_itl_s)):
            raise ValueError(f"Slo.mean_itl_s must be positive and finite or None, got {self.mean_itl_s}")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"Slo.percentile must be in (0, 100], got {self.percentile}")

    def meets(self, request: RequestLatency) -> bool:
        if not request.finished or not request.ttft_s < self.ttft_s:
            return False
        return self.mean_itl_s is None or request.mean_itl_s is None or request.mean_itl_s < self.mean_itl_s

    def attainment(self, requests: Sequence[RequestLatency]) -> float:
        """The fraction of requests that met the SLO (NaN for none)."""
        return sum(self.meets(r) for r in requests) / len(requests) if requests else math.nan

    def sustained(self, requests: Sequence[RequestLatency]) -> bool:
        """Every request finished and at least `percentile` percent met the SLO (none: False)."""
        if not requests or not all(r.finished for r in requests):
            return False
        # Counted, not divided: 99% of 100 requests is 99 of them, whatever the float says.
        return sum(self.meets(r) for r in requests) * 100 >= self.percentile * len(requests)

    def describe(self) -> str:
        """The per-request bounds in words: "TTFT < 2 s and mean ITL < 200 ms"."""
        text = f"TTFT < {self.ttft_s:g} s"
        return text if self.mean_itl_s is None else text + f" and mean ITL < {self.mean_itl_s * 1e3:g} ms"

    def describe_sustained(self) -> str:
        """The load rule in words: "p99 TTFT < 1 s"."""
        return f"p{self.percentile:g} {self.describe()}"
