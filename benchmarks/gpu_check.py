"""ddprun's checks on a machine with an NVIDIA GPU, each recorded as pass, fail or skip with its figures.

    python benchmarks/gpu_check.py [OUT_DIR] [--budget SECONDS] [--rehearse-on-cpu]

Usually started by benchmarks/gpu_check.sh. Steps, cheapest and most telling first; each has
its own timeout, is cut to what is left of --budget, and never stops the steps after it:

  scripts     the GPU scripts under benchmarks/gpu_scripts/ compile
  inventory   devices.read_inventory() (NVML) against nvidia-smi --query-gpu
  visible     `ddprun run --gpus 1` and CUDA_VISIBLE_DEVICES=GPU-<uuid prefix>: the rank's device UUID
  doctor      `ddprun doctor --json` with the nccl smoke test and bandwidth sweep
  oom         a rank that runs out of GPU memory: the failure panel names it and gives the hint
  kill9       SIGKILL to the launcher of a GPU job: no worker and no GPU memory left within 5 s
  train       `ddprun train` images/s against a plain torchvision loop, eager then --compile

Without a GPU (no NVML GPU, no nvidia-smi) every GPU step is skipped with the reason: a quick
dry run. --rehearse-on-cpu runs those steps on CPU instead (1 process, small sizes) to try the
plumbing; the facts only a GPU shows are then skipped within each step.
Writes OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.txt after every step (default ./gpu_check_out).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "benchmarks" / "gpu_scripts"
sys.path.insert(0, str(ROOT))  # this tree's ddprun, installed or not

from ddprun import devices  # noqa: E402  (after the path above)

PASS, FAIL, SKIP = "pass", "fail", "skip"
GPU_CHECK_NAMES = {
    "NVIDIA driver", "CUDA_VISIBLE_DEVICES", "torch CUDA build", "torch sees the GPUs", "GPU peer-to-peer",
    "distributed backends", "smoke test",
}
MUST_BE_OK_ON_GPU = ("NVIDIA driver", "cuda:0", "torch sees the GPUs", "smoke test")
OOM_HINT = "ran out of memory"  # ddprun/report.py's hint for a CUDA out-of-memory error
CLEAN_WITHIN_S = 5.0
MEMORY_SLACK_MIB = 256  # memory.used may differ this much from before the job and still be "free"
MIN_SPEED_RATIO = 0.90  # ddprun train (DDP, one GPU) against the plain loop


@dataclass
class StepResult:
    name: str
    status: str  # pass | fail | skip
    reason: str = ""  # why it failed or was skipped; what passed, briefly
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Target:
    """Where the GPU steps run: one GPU, or (rehearsal) one CPU process with small sizes."""

    gpu: bool
    launch: tuple[str, ...]  # ddprun's device flags
    model: str = "resnet50"
    batch_size: int = 128
    image_size: int = 224
    steps: int = 100
    hold_gib: float = 4.0


GPU_TARGET = Target(gpu=True, launch=("--gpus", "1"))
CPU_REHEARSAL = Target(gpu=False, launch=("--cpu", "--nproc", "1"), model="resnet18", batch_size=8,
                       image_size=32, steps=12, hold_gib=0.25)


# ---------------------------------------------------------------------------------------
# Pure parts: parsing, comparing, judging, summarising (tests/test_gpu_check.py)
# ---------------------------------------------------------------------------------------


def compare_inventories(nvml: Sequence[devices.Gpu], smi: Sequence[devices.Gpu]) -> list[str]:
    """What differs between the NVML inventory and nvidia-smi's ([] when they agree).

    Memory may differ by 1 MiB (rounding of the same byte count)."""
    problems = []
    if len(nvml) != len(smi):
        problems.append(f"NVML lists {len(nvml)} GPUs, nvidia-smi {len(smi)}")
    for a, b in zip(nvml, smi):
        for label, x, y in (("index", a.index, b.index), ("uuid", a.uuid, b.uuid), ("name", a.name, b.name)):
            if x != y:
                problems.append(f"GPU {a.index}: {label} {x!r} (NVML) != {y!r} (nvidia-smi)")
        if abs(a.memory_mib - b.memory_mib) > 1:
            problems.append(f"GPU {a.index}: memory {a.memory_mib} MiB (NVML) != {b.memory_mib} MiB (nvidia-smi)")
    return problems


def uuid_prefix(uuid: str, *, hex_chars: int = 8) -> str:
    """"GPU-8f2a6c1e" from "GPU-8f2a6c1e-3b4d-...": a prefix CUDA_VISIBLE_DEVICES accepts."""
    return uuid[: len("GPU-") + hex_chars]


def judge_visible(record: Optional[Mapping], *, expected_uuid: Optional[str], expected_cvd: str) -> list[str]:
    """Problems with what the rank saw (show_device.py's record); expected_uuid None: not checked."""
    if record is None:
        return ["the rank wrote no record"]
    problems = []
    if record.get("cuda_visible_devices") != expected_cvd:
        problems.append(f"CUDA_VISIBLE_DEVICES in the rank is {record.get('cuda_visible_devices')!r}, expected {expected_cvd!r}")
    if expected_uuid is not None and record.get("uuid") != expected_uuid:
        problems.append(f"the rank's device is {record.get('uuid')}, expected {expected_uuid}")
    return problems


def judge_doctor(report: Mapping, *, gpu: bool) -> tuple[list[str], dict]:
    """Problems with `ddprun doctor --json` output, and its figures.

    Every check must be ok or explain itself (a detail; a hint too when it warns or fails). On a
    GPU machine the driver, cuda:0, torch's view and the smoke test must be ok, with bandwidth rows."""
    checks = list(report.get("checks", []))
    problems = []
    for check in checks:
        status, name = check.get("status"), check.get("name", "?")
        if status == "ok":
            continue
        if not check.get("detail"):
            problems.append(f"{name}: {status} without a detail")
        if status in ("warn", "fail") and not check.get("hint"):
            problems.append(f"{name}: {status} without a hint ({check.get('detail')})")
    by_name = {check.get("name"): check for check in checks}
    if gpu:
        for name in MUST_BE_OK_ON_GPU:
            status = by_name.get(name, {}).get("status", "missing")
            if status != "ok":
                problems.append(f"{name}: {status} ({by_name.get(name, {}).get('detail', '')})")
    rows = list(report.get("bandwidth", []))
    if gpu and not rows:
        problems.append("no bandwidth rows")
    gpu_checks = {c["name"]: c["status"] for c in checks if is_gpu_check(c.get("name", ""))}
    figures = {"statuses": gpu_checks, "not_ok": [c for c in checks if c.get("status") != "ok"]}
    if rows:
        best = max(rows, key=lambda row: row.get("algbw_gbps", 0))
        figures["peak_algbw_gbps"] = best.get("algbw_gbps")
        figures["peak_at_bytes"] = best.get("bytes")
        figures["bandwidth"] = rows
    return problems, figures


def is_gpu_check(name: str) -> bool:
    return name in GPU_CHECK_NAMES or name.startswith(("cuda:", "smoke"))


def panel_text(stderr: str, *, title: str = "ddprun: job failed") -> str:
    """The failure panel's words on one line: borders dropped, wrapped lines joined."""
    start = stderr.find(title)
    if start < 0:
        return ""
    text = re.sub(r"[│╭╮╰╯─]", " ", stderr[start:])
    return " ".join(text.split())


def judge_oom(stderr: str, *, gpu: bool, script: str) -> list[str]:
    """The panel must name the out-of-memory error and the script's line; on GPU, give the hint."""
    panel = panel_text(stderr)
    if not panel:
        return ["no failure panel on stderr"]
    problems = []
    if f"{script}:" not in panel:
        problems.append(f"the panel does not name {script}:<line>")
    if gpu and "OutOfMemoryError" not in panel:
        problems.append("the panel does not name OutOfMemoryError")
    if gpu and OOM_HINT not in panel:
        problems.append(f"the panel has no hint with {OOM_HINT!r}")
    return problems


def parse_compute_apps(text: str) -> list[tuple[int, int]]:
    """(pid, used MiB) from `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`."""
    apps = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit():
            apps.append((int(fields[0]), int(fields[1]) if fields[1].isdigit() else 0))
    return apps


def parse_memory_used(text: str) -> Optional[int]:
    """MiB from `nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0`."""
    first = text.strip().splitlines()[:1]
    return int(first[0].strip()) if first and first[0].strip().isdigit() else None


def judge_speed(ddprun_speed: Optional[float], plain_speed: Optional[float]) -> tuple[list[str], dict]:
    if not ddprun_speed or not plain_speed:
        return [f"no images/s from {'ddprun train' if not ddprun_speed else 'the plain loop'}"], {}
    ratio = ddprun_speed / plain_speed
    figures = {"ddprun_images_per_s": round(ddprun_speed, 1), "plain_images_per_s": round(plain_speed, 1),
               "ratio": round(ratio, 3)}
    problems = [] if ratio >= MIN_SPEED_RATIO else [f"ddprun train reaches {ratio:.0%} of the plain loop (< {MIN_SPEED_RATIO:.0%})"]
    return problems, figures


def verdict(problems: Sequence[str], *, passed: str) -> tuple[str, str]:
    return (FAIL, "; ".join(problems)) if problems else (PASS, passed)


def summarize(results: Sequence[StepResult], *, context: Mapping[str, Any]) -> tuple[dict, str]:
    """The JSON document and the text summary of a run."""
    counts = {status: sum(1 for r in results if r.status == status) for status in (PASS, FAIL, SKIP)}
    document = {"context": dict(context), "counts": counts, "steps": [asdict(r) for r in results]}
    lines = [f"ddprun GPU check: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped"]
    lines += [f"  {key}: {value}" for key, value in context.items()]
    for r in results:
        lines.append(f"{r.status.upper():4}  {r.name:10} {r.seconds:6.1f} s  {r.reason}")
        for key, value in r.figures.items():
            if key not in ("bandwidth", "not_ok", "output_tail"):
                lines.append(f"      {key}: {value}")
    return document, "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# Running things
# ---------------------------------------------------------------------------------------


@dataclass
class Ran:
    returncode: Optional[int]  # None: timed out (the process group was killed)
    stdout: str
    stderr: str
    seconds: float


def child_env(extra: Optional[Mapping[str, str]] = None, *, drop: Sequence[str] = ()) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    paths = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update({"PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1", "COLUMNS": "200"})
    env.update(extra or {})
    return env


def run(argv: Sequence[str], *, timeout_s: float, env: Optional[Mapping[str, str]] = None) -> Ran:
    started = time.perf_counter()
    process = subprocess.Popen(list(argv), cwd=ROOT, env=dict(env or child_env()), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    try:
        out, err = process.communicate(timeout=max(1.0, timeout_s))
        code: Optional[int] = process.returncode
    except subprocess.TimeoutExpired:
        _kill_group(process.pid)
        out, err = process.communicate()
        code = None
    return Ran(code, out, err, time.perf_counter() - started)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass


def ddprun(*args: str) -> list[str]:
    return [sys.executable, "-m", "ddprun", *args]


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.splitlines()[-lines:])


def smi(*args: str) -> Optional[str]:
    if shutil.which("nvidia-smi") is None:
        return None
    done = run(["nvidia-smi", *args], timeout_s=20)
    return done.stdout if done.returncode == 0 else None


def failed_run(what: str, ran: Ran) -> str:
    how = "timed out" if ran.returncode is None else f"exit {ran.returncode}"
    return f"{what}: {how}: {tail(ran.stderr, 6)}"


# ---------------------------------------------------------------------------------------
# Steps: each returns (status, reason, figures); the driver times them and catches errors
# ---------------------------------------------------------------------------------------


@dataclass
class Context:
    out: Path
    target: Target
    inventory: list  # devices.Gpu from NVML (else nvidia-smi), read once at the start
    smi_present: bool
    deadline: float  # time.monotonic() by which every step must be done

    def timeout(self, wanted_s: float) -> float:
        return max(1.0, min(wanted_s, self.deadline - time.monotonic()))

    def scratch(self, name: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=f"gpu_check_{name}_"))
        return path


Outcome = tuple[str, str, dict]


def step_scripts(ctx: Context) -> Outcome:
    broken = []
    for script in sorted(SCRIPTS.glob("*.py")):
        try:
            compile(script.read_text(encoding="utf-8"), str(script), "exec")
        except SyntaxError as error:
            broken.append(f"{script.name}:{error.lineno}: {error.msg}")
    return (*verdict(broken, passed="every script compiles"), {"scripts": sorted(p.name for p in SCRIPTS.glob("*.py"))})


def step_inventory(ctx: Context) -> Outcome:
    nvml = devices._read_nvml_inventory()  # the NVML path alone: nvidia-smi must not stand in for it here
    text = smi(*devices._SMI_INVENTORY_ARGS)
    figures = {"nvml": [asdict(g) for g in nvml or []], "nvidia_smi": text}
    if nvml is None and text is None:
        return SKIP, "no NVIDIA driver: NVML does not load and nvidia-smi is absent", figures
    if nvml is None:
        return FAIL, "nvidia-smi answers but NVML (pynvml) does not", figures
    if text is None:
        return FAIL, "NVML answers but nvidia-smi does not", figures
    problems = compare_inventories(nvml, devices.parse_inventory_csv(text))
    driver = devices._read_nvml_driver_version()
    figures["driver_version"] = driver
    if driver is None:
        problems.append("NVML gives no driver version")
    return (*verdict(problems, passed=f"NVML and nvidia-smi agree on {len(nvml)} GPU(s)"), figures)


def step_visible(ctx: Context) -> Outcome:
    gpu0 = ctx.inventory[0] if ctx.target.gpu else None
    cases = [("--gpus 1" if gpu0 else "--cpu", None, "0" if gpu0 else None)]
    if gpu0:
        prefix = uuid_prefix(gpu0.uuid)
        cases.append((f"CUDA_VISIBLE_DEVICES={prefix}", prefix, prefix))
    problems, figures = [], {}
    for label, cvd, expected_cvd in cases:
        record_path = ctx.scratch("visible") / "record.json"
        env = child_env({"CUDA_VISIBLE_DEVICES": cvd} if cvd else None, drop=("CUDA_VISIBLE_DEVICES",))
        ran = run(ddprun("run", *ctx.target.launch, str(SCRIPTS / "show_device.py"), str(record_path)),
                  timeout_s=ctx.timeout(90), env=env)
        if ran.returncode != 0:
            problems.append(failed_run(label, ran))
            continue
        record = json.loads(record_path.read_text()) if record_path.exists() else None
        figures[label] = record
        found = judge_visible(record, expected_uuid=gpu0.uuid if gpu0 else None, expected_cvd=expected_cvd)
        problems += [f"{label}: {p}" for p in found]
    return (*verdict(problems, passed="the rank sees the selected GPU" if gpu0 else "rehearsed on CPU"), figures)


def step_doctor(ctx: Context) -> Outcome:
    args = ("doctor", "--json", "--timeout", "150") if ctx.target.gpu else ("doctor", "--json", "--max-bytes", "1M")
    ran = run(ddprun(*args), timeout_s=ctx.timeout(200))
    (ctx.out / "doctor.json").write_text(ran.stdout)
    try:
        report = json.loads(ran.stdout)
    except ValueError:
        return FAIL, failed_run("doctor printed no JSON", ran), {}
    problems, figures = judge_doctor(report, gpu=ctx.target.gpu)
    figures["exit_code"] = ran.returncode
    return (*verdict(problems, passed="every check is ok or explains itself"), figures)


def step_oom(ctx: Context) -> Outcome:
    ran = run(ddprun("run", *ctx.target.launch, str(SCRIPTS / "oom.py")), timeout_s=ctx.timeout(90))
    figures = {"exit_code": ran.returncode, "panel": panel_text(ran.stderr)}
    if ran.returncode in (0, None):
        return FAIL, failed_run("the OOM job did not fail", ran), figures
    problems = judge_oom(ran.stderr, gpu=ctx.target.gpu, script="oom.py")
    return (*verdict(problems, passed="the panel names the OOM and gives its hint"), figures)


def step_kill9(ctx: Context) -> Outcome:
    pid_dir = ctx.scratch("kill9")
    baseline = parse_memory_used(smi("--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0") or "")
    argv = ddprun("run", *ctx.target.launch, str(SCRIPTS / "hold_memory.py"), str(pid_dir), str(ctx.target.hold_gib))
    launcher = subprocess.Popen(argv, cwd=ROOT, env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        workers = _wait_for_pids(pid_dir, deadline=time.monotonic() + ctx.timeout(90))
        if not workers:
            return FAIL, "the job never reported its worker's pid", {}
        during = _gpu_snapshot()
        os.kill(launcher.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        launcher.wait()
        clean_after, last = _wait_clean(workers, baseline=baseline, since=killed_at)
    finally:
        _kill_group(launcher.pid)
        for pid in [pid for pid in _read_pids(pid_dir) if _alive(pid)]:  # leave nothing for the next steps
            os.kill(pid, signal.SIGKILL)
    figures = {"workers": workers, "memory_before_mib": baseline, "during": during, "after": last,
               "clean_after_s": None if clean_after is None else round(clean_after, 2)}
    if clean_after is None:
        return FAIL, f"not clean {CLEAN_WITHIN_S:g} s after kill -9: {last}", figures
    if ctx.target.gpu and not during["apps"]:
        return PASS, f"clean after {clean_after:.2f} s (nvidia-smi listed no process while the job ran)", figures
    return PASS, f"clean after {clean_after:.2f} s", figures


def _wait_for_pids(pid_dir: Path, *, deadline: float) -> list[int]:
    while time.monotonic() < deadline:
        found = _read_pids(pid_dir)
        if found:
            return found
        time.sleep(0.2)
    return []


def _read_pids(pid_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in pid_dir.glob("rank*.pid")]


def _gpu_snapshot() -> dict:
    apps = smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    used = smi("--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0")
    return {"apps": parse_compute_apps(apps or ""), "memory_used_mib": parse_memory_used(used or "")}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie holds no memory
    except (OSError, IndexError):
        return False


def _wait_clean(workers: Sequence[int], *, baseline: Optional[int], since: float) -> tuple[Optional[float], dict]:
    """Seconds after `since` until no worker lives, nvidia-smi lists none, and memory is back; None if not in time."""
    while True:
        snapshot = {**_gpu_snapshot(), "alive": [pid for pid in workers if _alive(pid)]}
        listed = [pid for pid, _ in snapshot["apps"] if pid in workers]
        used = snapshot["memory_used_mib"]
        memory_back = baseline is None or used is None or used <= baseline + MEMORY_SLACK_MIB
        elapsed = time.monotonic() - since
        if not snapshot["alive"] and not listed and memory_back:
            return elapsed, snapshot
        if elapsed > CLEAN_WITHIN_S:
            return None, snapshot
        time.sleep(0.1)


def step_train(ctx: Context, *, compile_: bool) -> Outcome:
    t = ctx.target
    shared = ["--model", t.model, "--batch-size", str(t.batch_size), "--image-size", str(t.image_size),
              "--amp", "bf16", "--channels-last"] + (["--compile"] if compile_ else [])
    scratch = ctx.scratch("train")
    metrics = scratch / "ddprun.json"
    train_argv = ddprun("train", *t.launch, "--data", "synthetic", "--max-steps", str(t.steps), "--epochs", "1",
                        "--dataset-size", str(t.steps * t.batch_size), "--metrics-json", str(metrics),
                        "--log-interval", "1000", *shared)
    warmup = min(5, t.steps // 5)  # the steps the trainer leaves out of its images/s (train.py train_loop)
    plain_argv = [sys.executable, str(SCRIPTS / "plain_loop.py"), "--steps", str(t.steps), "--warmup", str(warmup),
                  "--out", str(scratch / "plain.json"), *shared]
    wanted = 260 if compile_ else 120
    ran_train = run(train_argv, timeout_s=ctx.timeout(wanted))
    ran_plain = run(plain_argv, timeout_s=ctx.timeout(wanted), env=child_env(
        {"CUDA_VISIBLE_DEVICES": "0"} if t.gpu else None, drop=("CUDA_VISIBLE_DEVICES",)))
    runs = {"ddprun train": (ran_train, metrics), "plain loop": (ran_plain, scratch / "plain.json")}
    speeds, figures = {}, {"settings": " ".join(shared), "steps": t.steps}
    for label, (ran, path) in runs.items():
        figures[f"{label} wall_s"] = round(ran.seconds, 1)
        if ran.returncode != 0 or not path.exists():
            return FAIL, failed_run(label, ran), figures
        speeds[label] = json.loads(path.read_text()).get("samples_per_sec")
    problems, speed_figures = judge_speed(speeds["ddprun train"], speeds["plain loop"])
    figures.update(speed_figures)
    if not t.gpu:
        return PASS, f"rehearsed on CPU: {speed_figures}", figures
    return (*verdict(problems, passed=f"{speed_figures.get('ratio')} of the plain loop's images/s"), figures)


# ---------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------

Step = tuple[str, Callable[[Context], Outcome], bool]  # name, function, needs a GPU (or the rehearsal)

STEPS: list[Step] = [
    ("scripts", step_scripts, False),
    ("inventory", step_inventory, False),
    ("visible", step_visible, True),
    ("doctor", step_doctor, True),
    ("oom", step_oom, True),
    ("kill9", step_kill9, True),
    ("train", lambda ctx: step_train(ctx, compile_=False), True),
    ("compile", lambda ctx: step_train(ctx, compile_=True), True),
]


def run_step(name: str, function: Callable[[Context], Outcome], ctx: Context) -> StepResult:
    if time.monotonic() >= ctx.deadline:
        return StepResult(name, SKIP, "the time budget was spent by the steps before")
    started = time.perf_counter()
    try:
        status, reason, figures = function(ctx)
    except Exception as error:  # one broken step must not stop the others: record it
        status, reason, figures = FAIL, f"{type(error).__name__}: {error}", {}
    return StepResult(name, status, reason, round(time.perf_counter() - started, 1), figures)


def no_gpu_reason(inventory: Sequence[devices.Gpu], *, smi_present: bool) -> Optional[str]:
    if inventory:
        return None
    if smi_present:
        return "no GPU: nvidia-smi is present but neither it nor NVML lists a GPU"
    return "no GPU on this machine (NVML finds none, nvidia-smi is absent): dry run"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT") or "gpu_check_out")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds for all steps together")
    parser.add_argument("--rehearse-on-cpu", action="store_true", help="run the GPU steps on CPU, small")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    inventory = devices.read_inventory()
    smi_present = shutil.which("nvidia-smi") is not None
    skip_reason = no_gpu_reason(inventory, smi_present=smi_present)
    rehearse = args.rehearse_on_cpu and skip_reason is not None
    target = CPU_REHEARSAL if rehearse else GPU_TARGET
    ctx = Context(out=out, target=target, inventory=inventory, smi_present=smi_present,
                  deadline=time.monotonic() + args.budget)
    context = {"python": sys.executable, "gpus": [f"{g.index}: {g.name} ({g.uuid})" for g in inventory],
               "mode": "gpu" if skip_reason is None else ("cpu rehearsal" if rehearse else "dry (no GPU)"),
               "budget_s": args.budget, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    results: list[StepResult] = []
    for name, function, needs_gpu in STEPS:
        if needs_gpu and skip_reason and not rehearse:
            results.append(StepResult(name, SKIP, skip_reason))
        else:
            results.append(run_step(name, function, ctx))
        print(f"{results[-1].status.upper():4}  {name}: {results[-1].reason}", file=sys.stderr, flush=True)
        write(out, results, context)
    document, text = write(out, results, context)
    sys.stdout.write(text)
    return 1 if document["counts"][FAIL] else 0


def write(out: Path, results: Sequence[StepResult], context: Mapping[str, Any]) -> tuple[dict, str]:
    """Both files after every step, so a run cut short still leaves what it found."""
    document, text = summarize(results, context=context)
    (out / "gpu_check.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
    (out / "gpu_check.txt").write_text(text)
    return document, text


if __name__ == "__main__":
    sys.exit(main())
