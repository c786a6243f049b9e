"""Human and JSON output. Data goes to stdout, messages and progress to stderr."""

from __future__ import annotations

import json
import os
import sys
import time

import click


def emit_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def human_size(n: float | int | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=False)] if rows \
        else [len(h) for h in headers]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=False)).rstrip()]
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())
    return "\n".join(lines)


class ConsoleProgress:
    """Renders ops progress events on stderr when it is a terminal (or when forced).

    With MIGRT_PROGRESS=json in the environment every event is instead one JSON line on stderr
    (`{"progress": "phase", "name": "dump", "t": <seconds since start>, ...}`), whatever the other
    options: for scripts and the fault-injection tests, which act at a given phase."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.json = os.environ.get("MIGRT_PROGRESS") == "json"
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.total = 0
        self.done = 0
        self.started = time.monotonic()
        self.phase_name = ""

    def __call__(self, event: str, **f) -> None:
        if self.json:
            if event != "bytes" or f.get("bytes"):
                rec = {"progress": event, "t": round(time.monotonic() - self.started, 3), **f}
                sys.stderr.write(json.dumps(rec, default=str) + "\n")
                sys.stderr.flush()
            return
        if not self.enabled:
            return
        if event == "phase":
            self.phase_name = f.get("name", "")
            self.total = int(f.get("total_bytes") or 0)
            self.done = 0
            extra = f" ({human_size(self.total)})" if self.total else ""
            click.echo(f"  {self.phase_name}{extra} ...", err=True)
        elif event == "bytes":
            self.done += int(f.get("bytes") or 0)
            if self.total and sys.stderr.isatty():
                pct = 100.0 * self.done / self.total
                click.echo(f"\r    {pct:5.1f}% of {human_size(self.total)}", err=True, nl=False)
        elif event == "done":
            if self.total and sys.stderr.isatty():
                click.echo("", err=True)
            click.echo(f"  {f.get('name')}: {f.get('seconds', 0):.2f} s", err=True)
