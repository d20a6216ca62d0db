"""The compact panel shown on stderr before a launch: what will run where."""

from __future__ import annotations

from typing import Callable

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from ddprun.plan import LaunchPlan


def sayer(console: Console) -> Callable[[str], None]:
    """How the launcher says one line: `ddprun: ...`, the text never read as markup."""
    return lambda text: console.print(f"[bold]ddprun:[/] {escape(text)}")


def render_plan(plan: LaunchPlan) -> Panel:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    world = str(plan.world_size) if plan.world_size is not None else f"elastic, {plan.nnodes} nodes x {plan.nproc_per_node}"
    table.add_row("world", f"{world} = {plan.nnodes} node(s) x {plan.nproc_per_node} process(es), backend {plan.backend}")
    for local_rank, label in enumerate(plan.device_labels):
        table.add_row("local rank " + str(local_rank), escape(label))
    table.add_row("rendezvous", escape(_endpoint_text(plan)))
    table.add_row("logs", escape(plan.log_dir))
    if plan.launch.warm_start:
        table.add_row("start", "warm: every rank forked from one server that imports torch once (--fresh-start: "
                               "a new Python process per rank)")
    for name in sorted(plan.source):
        if plan.source[name] != "default" and not plan.source[name].startswith("--"):
            table.add_row("detected", escape(f"{name} from {plan.source[name]}"))
    for notice in plan.notices:
        table.add_row("note", escape(notice))
    return Panel(table, title=f"ddprun: {escape(plan.entrypoint)}", title_align="left", expand=False)


def _endpoint_text(plan: LaunchPlan) -> str:
    # The rendezvous id is a secret unless the user chose it (see build_plan): show the job id.
    chosen = plan.source.get("rdzv_id", "default") != "default"
    name = f"id {plan.rdzv_id}" if chosen else f"job {plan.job_id}"
    if plan.endpoint.endswith(":0"):
        return f"{plan.endpoint[:-2]} (a free port, held by ddprun), {name}"
    return f"{plan.endpoint}, {name}"
