"""The doctor's output: a Rich table for people (stderr), or JSON for machines (stdout)."""

from __future__ import annotations

import json
from typing import Mapping, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ddprun.doctor.checks import FAIL, OK, SKIP, WARN, CheckResult, human_bytes

SYMBOLS = {OK: ("✓", "green"), WARN: ("!", "yellow"), FAIL: ("✗", "bold red"), SKIP: ("-", "dim")}
BANDWIDTH_KEYS = ("bytes", "time_us", "algbw_gbps", "busbw_gbps")


def to_json(results: Sequence[CheckResult], bandwidth: Sequence[Mapping]) -> str:
    """{"checks": [{name, status, detail, hint}...], "bandwidth": [{bytes, time_us, algbw_gbps, busbw_gbps}...]}."""
    return json.dumps(
        {
            "checks": [{"name": r.name, "status": r.status, "detail": r.detail, "hint": r.hint} for r in results],
            "bandwidth": [{key: row[key] for key in BANDWIDTH_KEYS} for row in bandwidth],
        },
        indent=2,
    )


def checks_table(results: Sequence[CheckResult]) -> Table:
    """One row per check; the hint of a warn or fail goes under its detail."""
    table = Table(title="ddprun doctor", title_justify="left", show_header=True, header_style="bold", expand=False)
    table.add_column("", no_wrap=True, width=1)
    table.add_column("check", no_wrap=True, style="bold")
    table.add_column("detail", overflow="fold")
    for result in results:
        symbol, style = SYMBOLS.get(result.status, ("?", "red"))
        detail = Text(result.detail)
        if result.hint and result.status in (WARN, FAIL):
            detail.append("\n→ " + result.hint, style=style.replace("bold ", ""))
        table.add_row(Text(symbol, style=style), Text(result.name), detail)
    return table


def bandwidth_table(rows: Sequence[Mapping], *, title: str) -> Table:
    """The all-reduce sweep, laid out like nccl-tests."""
    table = Table(title=title, title_justify="left", header_style="bold")
    for name in ("size", "bytes", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
        table.add_column(name, justify="right")
    for row in rows:
        table.add_row(
            human_bytes(row["bytes"]),
            str(row["bytes"]),
            f"{row['time_us']:.1f}",
            f"{row['algbw_gbps']:.3f}",
            f"{row['busbw_gbps']:.3f}",
        )
    return table


def summary(results: Sequence[CheckResult], *, strict: bool) -> Text:
    fails = sum(r.status == FAIL for r in results)
    warns = sum(r.status == WARN for r in results)
    counts = f"{fails} failed, {warns} warning{'s' if warns != 1 else ''}"
    if fails or (strict and warns):
        why = "" if fails else " (--strict counts warnings as failures)"
        return Text(f"✗ Not ready for DDP: {counts}{why}", style="bold red")
    return Text(f"✓ Ready for DDP: {counts}", style="bold green")


def render(
    console: Console,
    *,
    results: Sequence[CheckResult],
    bandwidth: Sequence[Mapping],
    bandwidth_title: str,
    strict: bool,
) -> None:
    console.print(checks_table(results))
    if bandwidth:
        console.print(bandwidth_table(bandwidth, title=bandwidth_title))
    console.print(summary(results, strict=strict))
