"""Where is every rank? Ask the ranks for their stacks, read and group them, render them.

How a rank is asked (see worker/stackdump.py): each rank's bootstrap registers faulthandler on
the real-time signal SIGRTMIN+7, writing to `attempt_N/rank_G.stacks` (0600) in the job's private
folder. Asking is: note the file's size, send the signal, read what was appended. A rank is
signalled only when /proc/<pid>/status shows it catches that signal (an unprepared process would
die of it) and when the process started before its pid file was written (not a reused pid).
Each rank has `timeout_s` (2 s) to answer; one that does not is reported as not answering, with a
native stack from `py-spy dump --native` when py-spy is installed (optional, never required).
A rank that exited is listed with its exit code, which the launcher records in
`attempt_N/rank_G.exit` when it sees the rank die.

Grouping: ranks whose threads show identical stacks share one entry, summarized as
`ranks 0,2-7: train.py:88 in step -> all_reduce` (the innermost frame in the user's own files,
then what it was calling: the innermost frame's function, or the call on the user's line when
that line calls into C, e.g. `time.sleep`). In the details the user's frames are bold, torch's and
the standard library's dim.

Finding a job from another terminal: job folders live in the per-user root (runfolders) or under a
`--log-dir DIR` (also looked for in $DDPRUN_LOG_DIR). A job is running while the launcher that made
its folder runs. Jobs under any other --log-dir are named by their folder path.
"""

from __future__ import annotations

import contextlib
import json
import linecache
import os
import re
import shutil
import signal
import subprocess
import sysconfig
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Group
from rich.text import Text

from ddprun import runfolders
from ddprun.envnames import STACKS_SIGNAL_OFFSET
from ddprun.errors import UsageError
from ddprun.report import is_user_file, rank_ranges

ANSWER_TIMEOUT_S = 2.0
_POLL_S = 0.02
_PY_SPY_TIMEOUT_S = 5.0
_THREAD = re.compile(r"^(?P<current>Current thread|Thread) (?P<ident>0x[0-9a-fA-F]+)(?: \[[^\]]*\])? \(most recent call first\):$")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<func>.*)$')
_CALL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\s*\.\s*[A-Za-z_][A-Za-z0-9_]*)*)\s*\(")
_BOOTSTRAP = os.path.join("ddprun", "worker", "bootstrap.py")
_STDLIB_DIRS = tuple(sorted({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")}, key=len, reverse=True))
_RANK_FILE = re.compile(r"^rank_(\d+)\.pid$")
_ATTEMPT = re.compile(r"^attempt_(\d+)(?:\.(\d+))?$")
# Frames that mean "inside a collective or waiting for one": torch.distributed itself, DDP, and
# autograd's backward (where DDP all-reduces the gradients).
_COLLECTIVE_PARTS = ("/torch/distributed/", "/torch/nn/parallel/distributed.py", "/torch/autograd/")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str


@dataclass(frozen=True)
class Thread:
    ident: str
    current: bool  # the thread faulthandler's handler ran in
    frames: tuple[Frame, ...]  # outermost first, as a Python traceback


@dataclass(frozen=True)
class RankStacks:
    rank: int
    state: str  # "answered", "not answering", "exited", "not started"
    threads: tuple[Thread, ...] = ()  # the main thread last
    pid: int | None = None
    exitcode: int | None = None
    native: str | None = None  # py-spy's dump, when it ran
    detail: str = ""  # why a rank did not answer

    @property
    def main(self) -> Thread | None:
        return self.threads[-1] if self.threads else None


# --- faulthandler's dump ----------------------------------------------------------------------


def parse_dump(text: str) -> tuple[Thread, ...]:
    """Threads in faulthandler's order (newest first, the main thread last), frames outermost
    first. A second dump appended meanwhile repeats thread ids: the first one wins."""
    threads: list[Thread] = []
    seen: set[str] = set()
    ident, current, frames = None, False, []

    def close() -> None:
        if ident is not None and ident not in seen:
            seen.add(ident)
            threads.append(Thread(ident, current, tuple(reversed(frames))))

    for line in text.splitlines():
        header = _THREAD.match(line)
        frame = _FRAME.match(line)
        if header:
            close()
            ident, current, frames = header["ident"], header["current"] == "Current thread", []
        elif frame and ident is not None:
            number = int(frame["line"]) if frame["line"].isdigit() else 0
            frames.append(Frame(frame["file"], number, frame["func"]))
    close()
    return tuple(threads)


def catches_signal(status_text: str, signum: int) -> bool:
    """Whether /proc/<pid>/status (its SigCgt mask) shows `signum` caught."""
    for line in status_text.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split(":", 1)[1].strip(), 16) >> (signum - 1) & 1)
    return False


def stacks_signal() -> int:
    return int(signal.SIGRTMIN) + STACKS_SIGNAL_OFFSET


# --- summaries --------------------------------------------------------------------------------


def where(thread: Thread) -> str:
    """`train.py:88 in step -> all_reduce`: the innermost user frame, then what it was calling."""
    if not thread.frames:
        return "no Python frame"
    leaf = thread.frames[-1]
    user = next((f for f in reversed(thread.frames) if is_user_file(f.file)), None)
    if user is None:
        return f"{os.path.basename(leaf.file)}:{leaf.line} in {leaf.func}"
    text = f"{os.path.basename(user.file)}:{user.line} in {user.func}"
    callee = _called_on(leaf) if leaf is user else leaf.func
    return f"{text} -> {callee}" if callee else text


def _called_on(frame: Frame) -> str | None:
    """The call on a source line, e.g. `time.sleep` in `time.sleep(3600)`: the C function a
    frame without a deeper Python frame is in."""
    code = linecache.getline(frame.file, frame.line).strip()
    match = _CALL.search(code)
    return re.sub(r"\s+", "", match.group(1)) if match else None


def in_collective(stacks: RankStacks) -> bool:
    main = stacks.main
    return main is not None and any(part in f.file for f in main.frames for part in _COLLECTIVE_PARTS)


def _key(stacks: RankStacks) -> tuple:
    if stacks.state != "answered":
        return (stacks.state, stacks.rank)  # never grouped: each says its own exit code or reason
    return ("answered", tuple((t.frames) for t in stacks.threads))


def group(snapshot: Sequence[RankStacks]) -> list[list[RankStacks]]:
    """Ranks with identical stacks together, groups in the order of their lowest rank."""
    groups: dict[tuple, list[RankStacks]] = {}
    for stacks in sorted(snapshot, key=lambda s: s.rank):
        groups.setdefault(_key(stacks), []).append(stacks)
    return list(groups.values())


def signature(snapshot: Sequence[RankStacks]) -> tuple:
    """What must stay the same for no rank to have advanced (the stall watch compares these)."""
    return tuple((s.rank, _key(s)) for s in sorted(snapshot, key=lambda s: s.rank))


def _who(ranks: Sequence[RankStacks]) -> str:
    numbers = [r.rank for r in ranks]
    label = rank_ranges(numbers).replace(", ", ",")
    return f"rank {label}" if len(numbers) == 1 else f"ranks {label}"


def summary_line(ranks: Sequence[RankStacks]) -> str:
    first = ranks[0]
    if first.state == "answered":
        return f"{_who(ranks)}: {where(first.main)}" if first.main else f"{_who(ranks)}: no Python frame"
    if first.state == "exited":
        code = "unknown code" if first.exitcode is None else f"code {first.exitcode}"
        return f"{_who(ranks)}: exited ({code})"
    if first.state == "not started":
        return f"{_who(ranks)}: not started yet"
    return f"{_who(ranks)}: not answering" + (f" ({first.detail})" if first.detail else "")


# --- rendering --------------------------------------------------------------------------------


def render(snapshot: Sequence[RankStacks], *, title: str | None = None, details: bool = True) -> Group:
    """The summary lines, then each group's threads (main thread first), user frames in bold."""
    groups = group(snapshot)
    parts: list[Text] = [Text(title, style="bold")] if title else []
    parts += [_summary_text(g) for g in groups]
    if details:
        for ranks in groups:
            parts += _details(ranks)
    return Group(*parts)


def _summary_text(ranks: Sequence[RankStacks]) -> Text:
    style = "" if ranks[0].state == "answered" else "yellow"
    return Text(f"  {summary_line(ranks)}", style=style)


def _details(ranks: Sequence[RankStacks]) -> list[Text]:
    first = ranks[0]
    pids = ", ".join(str(r.pid) for r in ranks if r.pid is not None)
    out: list[Text] = []
    if first.threads:
        out.append(Text(f"\n{_who(ranks)}" + (f" (pid {pids})" if pids else ""), style="bold"))
        for thread in reversed(first.threads):  # the main thread first
            name = "main thread" if thread is first.main else f"thread {thread.ident}"
            out.append(Text(f"  {name}", style="dim" if thread is not first.main else ""))
            out += [_frame_text(f) for f in _without_launch_frames(thread.frames)]
    if first.native:
        out.append(Text(f"\n{_who(ranks)}: native stack (py-spy)", style="bold"))
        out += [Text(f"  {line}", style="dim") for line in first.native.rstrip().splitlines()]
    return out


def _without_launch_frames(frames: Sequence[Frame]) -> Sequence[Frame]:
    """Drop the leading frames of runpy and ddprun's bootstrap, as a plain `python script.py` has none."""
    start = 0
    while start < len(frames) and (frames[start].file.startswith("<frozen runpy>") or
                                   frames[start].file.endswith(_BOOTSTRAP) or
                                   os.path.basename(frames[start].file) == "runpy.py"):
        start += 1
    return frames[start:] if start < len(frames) else frames


def short_path(path: str, *, cwd: str | None = None) -> str:
    """A path as a reader knows it: inside the working directory relative to it, a library's
    from its package (torch/distributed/...), the standard library's by its name."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    base = (cwd or os.getcwd()).rstrip(os.sep) + os.sep
    if path.startswith(base):
        return path[len(base):]
    for lib in _STDLIB_DIRS:
        if path.startswith(lib + os.sep):
            return path[len(lib) + 1:]
    return path


def _frame_text(frame: Frame) -> Text:
    user = is_user_file(frame.file)
    text = Text(f'    File "{short_path(frame.file)}", line {frame.line}, in {frame.func}',
                style="bold" if user else "dim", no_wrap=True, overflow="ignore")
    code = linecache.getline(frame.file, frame.line).strip() if user else ""
    if code:
        text.append(f"\n      {code}", style="bold")
    return text


# --- asking the ranks -------------------------------------------------------------------------


@dataclass
class _Asked:
    rank: int
    pid: int
    path: Path
    offset: int
    size_seen: int = -1
    stable_since: float | None = None


def rank_numbers(attempt_dir: Path) -> list[int]:
    try:
        names = os.listdir(attempt_dir)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_RANK_FILE.match, names) if m)


def collect(attempt_dir: Path, *, timeout_s: float = ANSWER_TIMEOUT_S, native: bool = False) -> list[RankStacks]:
    """Every rank of one attempt: asked at once, each answering within `timeout_s` or reported."""
    results: dict[int, RankStacks] = {}
    asked: list[_Asked] = []
    signum = stacks_signal()
    for rank in rank_numbers(attempt_dir):
        outcome = _ask(attempt_dir, rank, signum=signum)
        if isinstance(outcome, _Asked):
            asked.append(outcome)
        else:
            results[rank] = outcome
    for rank, stacks in _await_answers(asked, timeout_s=timeout_s).items():
        results[rank] = stacks
    py_spy = shutil.which("py-spy")
    if py_spy:
        results = {rank: _with_native(s, py_spy=py_spy) if native or s.state == "not answering" else s
                   for rank, s in results.items()}
    return [results[rank] for rank in sorted(results)]


def _ask(attempt_dir: Path, rank: int, *, signum: int) -> _Asked | RankStacks:
    exitcode = read_exit_record(attempt_dir, rank)
    pid_file = attempt_dir / f"rank_{rank}.pid"
    pid = _read_int(pid_file)
    if exitcode is not None:
        return RankStacks(rank, "exited", pid=pid, exitcode=exitcode)
    if pid is None:
        return RankStacks(rank, "not started")
    status = _proc_status(pid)
    if status is None or _is_zombie(status) or not _started_before(pid, pid_file):
        return RankStacks(rank, "exited", pid=pid, exitcode=read_exit_record(attempt_dir, rank))
    if not catches_signal(status, signum):
        return RankStacks(rank, "not answering", pid=pid, detail="it has not set up stack dumps yet")
    path = attempt_dir / f"rank_{rank}.stacks"
    offset = _size(path)
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return RankStacks(rank, "exited", pid=pid, exitcode=read_exit_record(attempt_dir, rank))
    except PermissionError:
        return RankStacks(rank, "not answering", pid=pid, detail="not allowed to signal it")
    return _Asked(rank, pid, path, offset)


def _await_answers(asked: list[_Asked], *, timeout_s: float) -> dict[int, RankStacks]:
    """Poll the stacks files until each has grown and then stopped growing (faulthandler writes
    a dump in one go from its signal handler), or the time is up."""
    done: dict[int, RankStacks] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(asked) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        now = time.monotonic()
        for item in asked:
            if item.rank in done:
                continue
            size = _size(item.path)
            if size <= item.offset or size != item.size_seen:
                item.size_seen, item.stable_since = size, now
            elif now - item.stable_since >= 2 * _POLL_S:
                done[item.rank] = RankStacks(item.rank, "answered", parse_dump(_read_from(item.path, item.offset)),
                                             pid=item.pid)
    for item in asked:
        if item.rank not in done:
            answered = _size(item.path) > item.offset
            threads = parse_dump(_read_from(item.path, item.offset)) if answered else ()
            done[item.rank] = (RankStacks(item.rank, "answered", threads, pid=item.pid) if threads else
                               RankStacks(item.rank, "not answering", pid=item.pid,
                                          detail=f"no answer within {timeout_s:g} s"))
    return done


def _with_native(stacks: RankStacks, *, py_spy: str) -> RankStacks:
    if stacks.pid is None or stacks.state == "exited":
        return stacks
    try:
        done = subprocess.run([py_spy, "dump", "--native", "--pid", str(stacks.pid)], capture_output=True,
                              text=True, timeout=_PY_SPY_TIMEOUT_S)
        text = done.stdout if done.returncode == 0 else f"py-spy failed: {done.stderr.strip()[:300]}"
    except (OSError, subprocess.TimeoutExpired) as error:
        text = f"py-spy failed: {error}"
    return RankStacks(stacks.rank, stacks.state, stacks.threads, stacks.pid, stacks.exitcode, text, stacks.detail)


def write_exit_record(attempt_dir: Path, rank: int, exitcode: int) -> None:
    """The launcher's note that `rank` exited (negative: killed by that signal)."""
    path = attempt_dir / f"rank_{rank}.exit"
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as stream:
            stream.write(f"{exitcode}\n")


def read_exit_record(attempt_dir: Path, rank: int) -> int | None:
    return _read_int(attempt_dir / f"rank_{rank}.exit")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as stream:
            stream.seek(offset)
            return stream.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _proc_status(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None


def _is_zombie(status: str) -> bool:
    return any(line.startswith("State:") and "Z" in line.split()[1:2] for line in status.splitlines())


def _started_before(pid: int, pid_file: Path) -> bool:
    """The process started before it wrote its pid file: not a later process given the same pid."""
    import psutil

    try:
        return psutil.Process(pid).create_time() <= pid_file.stat().st_mtime + 1.0
    except (psutil.Error, OSError):
        return False


# --- finding the job --------------------------------------------------------------------------


def latest_attempt(job_dir: Path) -> Path | None:
    """The newest attempt_N (or attempt_N.k) folder of a job."""
    found = []
    with contextlib.suppress(OSError):
        for name in os.listdir(job_dir):
            match = _ATTEMPT.match(name)
            if match:
                found.append(((int(match.group(1)), int(match.group(2) or 1)), name))
    return job_dir / max(found)[1] if found else None


def search_roots(env: Mapping[str, str]) -> list[str]:
    """Where `ddprun stacks` looks for jobs: the per-user root, and $DDPRUN_LOG_DIR when set."""
    roots = [runfolders.default_root()]
    if env.get("DDPRUN_LOG_DIR"):
        roots.append(os.path.abspath(env["DDPRUN_LOG_DIR"]))
    return roots


def find_job(job: str | None, *, roots: Sequence[str], uid: int) -> Path:
    """The running job's folder: named by id or path, or the only running job of this user."""
    if job is None:
        running = [Path(root) / name for root in roots for name in runfolders.running_jobs(root, uid=uid)]
        if not running:
            raise UsageError(f"no running ddprun job of yours under {' or '.join(roots)}; start one with ddprun run, "
                             "or name a job folder: ddprun stacks DIR/<job id>")
        if len(running) > 1:
            listed = ", ".join(str(p) for p in running)
            raise UsageError(f"{len(running)} jobs are running: {listed}; name one, e.g. ddprun stacks {running[0].name}")
        return running[0]
    path = Path(job) if ("/" in job or os.path.isdir(job)) else None
    candidates = [path] if path is not None else [Path(root) / job for root in roots]
    folder = next((c for c in candidates if c.is_dir()), None)
    if folder is None:
        raise UsageError(f"{job}: no such job; `ddprun stacks` with no argument finds your running job")
    return _check_job_folder(folder.absolute(), uid=uid)


def _check_job_folder(folder: Path, *, uid: int) -> Path:
    try:
        owner = folder.stat().st_uid
    except OSError as error:
        raise UsageError(f"{folder}: {error.strerror}") from None
    if owner != uid:
        raise UsageError(f"{folder} belongs to another user (uid {owner}); ddprun stacks shows only your own jobs")
    launcher = runfolders.job_launcher(folder)
    if launcher is None:
        raise UsageError(f"{folder} is not a ddprun job folder (no {runfolders.MARKER} of yours in it)")
    if not runfolders.launcher_running(launcher):
        raise UsageError(f"{folder.name} is not running any more (its launcher, pid {launcher.get('pid')}, has ended)")
    return folder


# --- collective timeouts ----------------------------------------------------------------------

_TIMEOUT_MARKERS = (
    re.compile(r"timed out waiting .* for (recv|send)", re.IGNORECASE),  # gloo
    re.compile(r"watchdog caught collective operation timeout", re.IGNORECASE),  # NCCL
    re.compile(r"collective operation timeout", re.IGNORECASE),
    re.compile(r"connection closed by peer", re.IGNORECASE),  # gloo, a peer gave up first
)


def looks_like_collective_timeout(text: str | None) -> bool:
    return bool(text) and any(marker.search(text) for marker in _TIMEOUT_MARKERS)


def culprit_lines(snapshot: Sequence[RankStacks], *, failed_rank: int) -> list[str]:
    """Lines naming the ranks that were not inside a collective when `failed_rank` gave up."""
    alive = [s for s in snapshot if s.rank != failed_rank and s.state == "answered"]
    if not alive:
        return []
    outside = [s for s in alive if not in_collective(s)]
    if not outside:
        return [f"Every other rank was inside a collective: {'; '.join(summary_line(g) for g in group(alive))} "
                "(mismatched collectives, or a rank on another node)."]
    return [f"Likely cause: {summary_line(g)} (not inside a collective)" for g in group(outside)]


# --- NCCL flight recorder ---------------------------------------------------------------------


@dataclass(frozen=True)
class FlightRecord:
    rank: int
    path: Path
    last_seq: int | None = None  # the last collective's sequence number in the dump
    last_op: str | None = None
    last_state: str | None = None
    entries: list = field(default_factory=list, compare=False, repr=False)


def flight_records(prefix: str) -> list[FlightRecord]:
    """The NCCL flight recorder's dumps `<prefix><rank>` (torch writes them on a collective
    timeout), each with its last collective, read with an unpickler that allows no classes."""
    folder, stem = os.path.split(prefix)
    records = []
    with contextlib.suppress(OSError):
        for name in sorted(os.listdir(folder)):
            if name.startswith(stem) and name[len(stem):].isdigit():
                records.append(_read_flight_record(int(name[len(stem):]), Path(folder) / name))
    return sorted(records, key=lambda r: r.rank)


def _read_flight_record(rank: int, path: Path) -> FlightRecord:
    import pickle

    class _PlainOnly(pickle.Unpickler):
        def find_class(self, module: str, name: str):  # noqa: ANN201 - refuse every class
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed")

    try:
        with open(path, "rb") as stream:
            dump = _PlainOnly(stream).load()
        entries = [e for e in dump.get("entries", []) if isinstance(e, dict)]
    except Exception:  # any unreadable dump is still pointed at
        return FlightRecord(rank, path)
    last = max(entries, key=lambda e: e.get("collective_seq_id", -1), default=None)
    if last is None:
        return FlightRecord(rank, path)
    return FlightRecord(rank, path, last.get("collective_seq_id"), last.get("profiling_name"), last.get("state"))


def flight_record_lines(records: Sequence[FlightRecord], *, folder: str) -> list[str]:
    if not records:
        return []
    lines = [f"NCCL flight recorder dumps in {folder}:"]
    for r in records:
        last = (f"last collective #{r.last_seq} {r.last_op or ''} ({r.last_state})" if r.last_seq is not None
                else "no collective recorded")
        lines.append(f"  rank {r.rank}: {last.replace('  ', ' ')}")
    lines.append(f"  analyse them with: torchfrtrace {folder} -p {os.path.basename(str(records[0].path)).rstrip('0123456789')}")
    return lines


def to_json(snapshot: Sequence[RankStacks]) -> str:
    def rank(s: RankStacks) -> dict:
        return {"rank": s.rank, "state": s.state, "pid": s.pid, "exitcode": s.exitcode, "detail": s.detail,
                "where": where(s.main) if s.main else None, "native": s.native,
                "threads": [{"ident": t.ident, "current": t.current,
                             "frames": [{"file": f.file, "line": f.line, "func": f.func} for f in t.frames]}
                            for t in s.threads]}
    return json.dumps([rank(s) for s in snapshot], indent=2)
