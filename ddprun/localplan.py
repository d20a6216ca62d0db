"""The plan for a launch from this process, now: build_plan fed with what this machine says.

The CLI (`ddprun run`, `ddprun train`) and the Python API (`ddprun.launch`, `ddprun.plan`)
both call `plan_here`, so a job started either way is decided by the same inputs: this
process's environment, the GPU inventory (skipped with --cpu), the core count, a fresh job id
and rendezvous secret, the installed torch's release and the per-user log root. No torch
import: the release comes from package metadata.
"""

from __future__ import annotations

import os
import secrets
import uuid
from typing import Any, Callable

from ddprun import devices, runfolders, torch_internals
from ddprun.plan import LaunchOptions, LaunchPlan, build_plan


def plan_here(options: LaunchOptions, *, warn: Callable[[str], None], **inputs: Any) -> LaunchPlan:
    """The LaunchPlan for `options` on this machine; `warn` gets notices about the torch release.
    `inputs`: build_plan's other inputs that the caller knows (the CLI: whether it runs in a terminal)."""
    return build_plan(
        options,
        env=os.environ,
        inventory=[] if options.cpu else devices.read_inventory(),
        cpu_count=os.cpu_count() or 1,
        job_id=f"ddprun-{uuid.uuid4().hex[:12]}",
        rdzv_secret=f"ddprun-{secrets.token_hex(16)}",  # 128 random bits, shown nowhere
        torch_version=installed_torch(warn=warn),
        log_root=runfolders.default_root(),  # a path only: it is made at launch, never on --dry-run
        **inputs,
    )


def installed_torch(*, warn: Callable[[str], None]) -> str:
    """The installed torch's release, refused below the supported floor (no torch import)."""
    version = torch_internals.installed_torch_version()
    for notice in torch_internals.check_torch_version(version):
        warn(notice)
    return version
