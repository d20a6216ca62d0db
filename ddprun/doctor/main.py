"""`ddprun doctor`: gather the facts, run the checks, run the live smoke test, report.

The smoke test is launched through ddprun's own `run` command in a subprocess of its own
process group, under a hard timeout: the doctor never hangs, and a pass means real jobs start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from rich.console import Console

from ddprun import devices
from ddprun.doctor import checks, probe, render
from ddprun.doctor.checks import FAIL, WARN, CheckResult
from ddprun.errors import UsageError

SMOKE_MODULE = "ddprun.doctor.smoke"
CPU_RANKS = 2
STOP_GRACE_S = 5.0  # after SIGTERM, the launcher gets this long to stop its workers
OUTPUT_TAIL_CHARS = 4000


@dataclass(frozen=True)
class SmokePlan:
    """How the smoke test will run: `ddprun run` flags, the worker's flags, what to expect."""

    launch_flags: tuple[str, ...]
    smoke_flags: tuple[str, ...]
    nranks: int
    backend: str
    timeout_s: float


@dataclass(frozen=True)
class SmokeOutcome:
    results: tuple[CheckResult, ...]
    bandwidth: tuple[Mapping, ...]


def run_doctor(
    *,
    smoke: bool = True,
    max_bytes: int | None = None,
    timeout_s: float = 60.0,
    strict: bool = False,
    as_json: bool = False,
    console: Console | None = None,
) -> int:
    """Check this machine for DDP; 0 when nothing failed (with strict, nothing warned), else 1.

    Raises UsageError for a timeout or size that cannot work, before anything runs.
    """
    check_options(max_bytes=max_bytes, timeout_s=timeout_s)
    console = console or Console(stderr=True)
    with console.status("ddprun doctor: checking this machine"):
        facts = probe.gather(dict(os.environ))
    results = evaluate(facts)
    bandwidth: Sequence[Mapping] = ()
    plan = None
    if smoke and facts.torch.version is None:
        results.append(CheckResult("smoke test", checks.SKIP, "not run: torch cannot be imported"))
    elif smoke:
        plan = plan_smoke(facts, max_bytes=max_bytes, timeout_s=timeout_s)
        with console.status(f"ddprun doctor: smoke test, {plan.nranks} ranks on {plan.backend}"):
            outcome = run_smoke(plan)
        results += list(outcome.results)
        bandwidth = outcome.bandwidth
    if as_json:
        sys.stdout.write(render.to_json(results, bandwidth) + "\n")
        sys.stdout.flush()
    else:
        title = f"all_reduce bandwidth, {plan.nranks} ranks on {plan.backend}" if plan else ""
        render.render(console, results=results, bandwidth=bandwidth, bandwidth_title=title, strict=strict)
    return exit_code(results, strict=strict)


def check_options(*, max_bytes: int | None, timeout_s: float) -> None:
    if not timeout_s > 0:
        raise UsageError(f"--timeout {timeout_s:g}: give a number of seconds above 0, e.g. --timeout 120")
    if max_bytes is not None and max_bytes < 8:
        raise UsageError(f"--max-bytes {max_bytes}: the sweep starts at 8 bytes; give 8 or more, e.g. --max-bytes 64M")


def exit_code(results: Sequence[CheckResult], *, strict: bool) -> int:
    bad = (FAIL, WARN) if strict else (FAIL,)
    return 1 if any(result.status in bad for result in results) else 0


# ---------------------------------------------------------------------------------------
# Facts -> checks
# ---------------------------------------------------------------------------------------


def evaluate(facts: probe.Facts) -> list[CheckResult]:
    """Every check, in report order: system, PyTorch, GPUs, network, environment."""
    return (
        system_checks(facts.system) + torch_checks(facts) + gpu_checks(facts) + net_checks(facts) + env_checks(facts)
    )


def system_checks(s: probe.SystemFacts) -> list[CheckResult]:
    return [
        checks.check_python(version=s.python_version, executable=s.executable),
        checks.check_os(system=s.system, release=s.release, machine=s.machine),
        checks.check_cpu(cores=s.cores, affinity=s.affinity),
        checks.check_memory(total_bytes=s.mem_total, available_bytes=s.mem_available),
        checks.check_shm(total_bytes=s.shm_total, free_bytes=s.shm_free),
        checks.check_open_files(soft=s.nofile[0], hard=s.nofile[1]),
        checks.check_memlock(soft=s.memlock[0], hard=s.memlock[1], infiniband_devices=s.infiniband),
    ]


def torch_checks(facts: probe.Facts) -> list[CheckResult]:
    t = facts.torch
    found = [
        checks.check_torch(version=t.version, cuda_build=t.cuda_build, cudnn=t.cudnn, nccl=t.nccl, error=t.error)
    ]
    if t.version is None:
        return found
    return found + [
        checks.check_torchvision(version=t.torchvision, torch_version=t.version),
        checks.check_backends(gloo=t.gloo, nccl=t.nccl_available, mpi=t.mpi, gpus_usable=bool(t.device_count)),
        checks.check_torch_cuda_build(cuda_build=t.cuda_build, driver_version=facts.driver_version),
    ]


def visible_or_none(facts: probe.Facts) -> list[devices.VisibleGpu] | None:
    """The visible GPUs as the launcher reads CUDA_VISIBLE_DEVICES; None when the value is invalid."""
    try:
        return devices.visible_gpus(facts.env.get(devices.VISIBLE_DEVICES_VAR), facts.inventory)
    except UsageError:
        return None


def gpu_checks(facts: probe.Facts) -> list[CheckResult]:
    t = facts.torch
    visible = visible_or_none(facts)
    found = [
        checks.check_driver(driver_version=facts.driver_version, gpu_count=len(facts.inventory)),
        checks.check_visible_devices(value=facts.env.get(devices.VISIBLE_DEVICES_VAR), inventory=facts.inventory),
    ]
    for ordinal, gpu in enumerate(visible or []):
        found.append(
            checks.check_gpu(
                ordinal=ordinal, visible=gpu, torch_gpu=match_torch_gpu(gpu, ordinal, t.gpus), arch_list=t.arch_list
            )
        )
    found.append(
        checks.check_device_count(
            torch_count=t.device_count,
            visible_count=None if visible is None else len(visible),
            cuda_build=t.cuda_build,
            driver_version=facts.driver_version,
        )
    )
    found.append(checks.check_p2p(matrix=t.p2p, visible_count=None if visible is None else len(visible)))
    return found


def match_torch_gpu(
    visible: devices.VisibleGpu, ordinal: int, torch_gpus: Sequence[checks.TorchGpu]
) -> checks.TorchGpu | None:
    """torch's view of a visible GPU: by UUID (CUDA may number GPUs differently), else by position."""
    if visible.gpu is not None:
        for candidate in torch_gpus:
            if candidate.uuid.lower() == visible.gpu.uuid.lower():
                return candidate
    return torch_gpus[ordinal] if ordinal < len(torch_gpus) else None


def net_checks(facts: probe.Facts) -> list[CheckResult]:
    n, env = facts.net, facts.env
    ifnames = [
        checks.check_socket_ifname(variable=variable, value=env.get(variable), interfaces=n.interfaces)
        for variable in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
    ]
    return [
        checks.check_hostname(
            hostname=n.hostname, addresses=n.host_addresses, error=n.host_error, interfaces=n.interfaces
        ),
        checks.check_interfaces(interfaces=n.interfaces),
        *ifnames,
        checks.check_master_addr(
            value=env.get("MASTER_ADDR"), addresses=n.master_addr_addresses, error=n.master_addr_error
        ),
        checks.check_port(port=n.port, free=n.port_free, holder=n.port_holder),
    ]


def env_checks(facts: probe.Facts) -> list[CheckResult]:
    matrix = facts.torch.p2p
    p2p_works = None if matrix is None else all(all(row) for row in matrix)
    combos = checks.check_env_combinations(
        env=facts.env, p2p_works=p2p_works, infiniband_devices=facts.system.infiniband, cores=facts.system.cores
    )
    return [checks.check_env_listing(env=facts.env)] + combos


# ---------------------------------------------------------------------------------------
# The live smoke test
# ---------------------------------------------------------------------------------------


def plan_smoke(facts: probe.Facts, *, max_bytes: int | None, timeout_s: float) -> SmokePlan:
    """One rank per GPU torch can use, on nccl; else 2 CPU ranks on gloo."""
    gpus = facts.torch.device_count or 0
    if gpus and facts.torch.nccl_available:
        launch_flags, nranks, backend = ("--gpus", "all"), gpus, "nccl"
    else:
        launch_flags, nranks, backend = ("--nproc", str(CPU_RANKS), "--cpu"), CPU_RANKS, "gloo"
    # The process group times out before the doctor does, so a hang usually comes back as an error.
    smoke_flags: tuple[str, ...] = (
        "--backend", backend,
        "--timeout", f"{max(5.0, timeout_s - 15.0):g}",
        "--sweep-budget", f"{max(2.0, timeout_s / 4):g}",
    )
    if max_bytes is not None:
        smoke_flags += ("--max-bytes", str(max_bytes))
    return SmokePlan(
        launch_flags=launch_flags, smoke_flags=smoke_flags, nranks=nranks, backend=backend, timeout_s=timeout_s
    )


def smoke_argv(plan: SmokePlan, *, out: Path, progress_dir: Path, log_dir: Path) -> list[str]:
    """The smoke job, started through ddprun's own launch path."""
    return [
        sys.executable, "-m", "ddprun", "run", *plan.launch_flags, "--log-dir", str(log_dir),
        "-m", SMOKE_MODULE, "--", *plan.smoke_flags, "--out", str(out), "--progress-dir", str(progress_dir),
    ]


def run_smoke(plan: SmokePlan) -> SmokeOutcome:
    with tempfile.TemporaryDirectory(prefix="ddprun-doctor-") as tmp:
        work = Path(tmp)
        progress_dir, out, log_path = work / "progress", work / "smoke.json", work / "output.log"
        progress_dir.mkdir()
        # The job's own log folder goes in our temp folder, so nothing is left behind.
        argv = smoke_argv(plan, out=out, progress_dir=progress_dir, log_dir=work / "logs")
        returncode, timed_out, progress = launch(
            argv, log_path=log_path, timeout_s=plan.timeout_s, progress_dir=progress_dir
        )
        report = read_report(out, nranks=plan.nranks)
        tail = read_tail(log_path)
    results = checks.check_smoke(
        report=report,
        returncode=returncode,
        timed_out=timed_out,
        timeout_s=plan.timeout_s,
        progress=progress,
        output_tail=tail,
        backend=plan.backend,
        nranks=plan.nranks,
    )
    bandwidth = tuple((report or {}).get("bandwidth", ()))
    if bandwidth:
        results.append(checks.check_bandwidth(rows=bandwidth, backend=plan.backend, nranks=plan.nranks))
    return SmokeOutcome(results=tuple(results), bandwidth=bandwidth)


def launch(
    argv: Sequence[str], *, log_path: Path, timeout_s: float, progress_dir: Path
) -> tuple[int | None, bool, list[checks.Progress]]:
    """Run argv in a new process group with a hard timeout: (exit code, timed out, progress at the timeout)."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=smoke_env(os.environ),
            start_new_session=True,  # its own process group: one signal reaches the launcher and its helpers
        )
        try:
            return process.wait(timeout=timeout_s), False, read_progress(progress_dir)
        except subprocess.TimeoutExpired:
            progress = read_progress(progress_dir)  # before stopping: shutdown would overwrite it
            stop(process, worker_pids=[p.pid for p in progress])
            return process.returncode, True, progress
        except BaseException:  # Ctrl-C: leave nothing running
            stop(process, worker_pids=[p.pid for p in read_progress(progress_dir)])
            raise


def smoke_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment for the smoke job: this very ddprun first on the path, unbuffered output."""
    package_parent = str(Path(__file__).resolve().parents[2])
    paths = [package_parent] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**env, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def stop(process: subprocess.Popen, *, worker_pids: Sequence[int]) -> None:
    """SIGTERM to the launcher's group (it stops its workers), SIGKILL after a grace period, then any straggler."""
    _signal_group(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        _signal_group(process.pid, signal.SIGKILL)
        process.wait()
    # torch elastic starts each worker in a session of its own, out of reach of the group signal.
    for pid in worker_pids:
        if _is_smoke_worker(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except OSError:
        pass  # already gone


def _is_smoke_worker(pid: int) -> bool:
    import psutil

    try:
        return any(SMOKE_MODULE in arg for arg in psutil.Process(pid).cmdline())
    except psutil.Error:
        return False


def read_progress(progress_dir: Path) -> list[checks.Progress]:
    found = []
    for path in sorted(progress_dir.glob("rank*")):
        rank = path.name[len("rank") :]
        if not rank.isdigit():
            continue  # rank0.tmp while it is being written
        try:
            mark = checks.parse_progress(int(rank), path.read_text(encoding="utf-8"))
        except OSError:
            continue
        if mark is not None:
            found.append(mark)
    return found


def read_report(out: Path, *, nranks: int) -> Mapping | None:
    """Rank 0's results, with the first failure of another rank where rank 0 recorded none."""
    others = {rank: _read_json(Path(checks.rank_report_path(str(out), rank))) for rank in range(1, nranks)}
    return checks.with_other_ranks_failure(_read_json(out), {r: o for r, o in others.items() if o is not None})


def _read_json(path: Path) -> dict | None:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return report if isinstance(report, dict) else None


def read_tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, path.stat().st_size - OUTPUT_TAIL_CHARS))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
