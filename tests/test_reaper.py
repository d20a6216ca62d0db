"""Nothing outlives the job: what the workers start is stopped when the job ends, however it ends."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import SCRIPTS, ddprun_command, run_ddprun
from ddprun import reaper
from ddprun.envnames import JOB_MARKER_ENV
from test_lifecycle import alive, wait_gone

SCRIPT = str(SCRIPTS / "grandchildren.py")
GONE_WITHIN_S = 10


# --- pure parts -------------------------------------------------------------------------------


def test_the_watchdog_kills_only_when_the_launcher_ends_without_saying_done():
    for said, died in ((b"d", False), (b"", True), (b"xyz", True), (b"xd", False)):
        read_fd, write_fd = os.pipe()
        os.write(write_fd, said)
        os.close(write_fd)
        try:
            assert reaper.launcher_died(read_fd) is died, said
        finally:
            os.close(read_fd)


def test_a_marker_is_this_launchers_own():
    first, second = reaper.new_marker(1234), reaper.new_marker(1234)
    assert first.startswith("1234-") and first != second
    assert reaper.is_marked({JOB_MARKER_ENV: first}, marker=first)
    assert not reaper.is_marked({JOB_MARKER_ENV: second}, marker=first)
    assert not reaper.is_marked({}, marker=first)


def test_the_watchdog_runs_this_ddprun_without_the_marker():
    env = reaper._watchdog_env({JOB_MARKER_ENV: "1-ab", "PYTHONPATH": "/x", "HOME": "/h"})
    assert JOB_MARKER_ENV not in env and env["HOME"] == "/h"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(Path(reaper.__file__).resolve().parents[1]), "/x"]


# --- job_reaper in a small process of its own (no torch) ---------------------------------------

# Writes its pid to argv[1], then sleeps; argv[2] says how it avoids being stopped.
LEFTOVER = """
import os, signal, sys, time
if sys.argv[2] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    os.setsid()
open(sys.argv[1] + ".tmp", "w").write(str(os.getpid())); os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(300)
"""
# Starts one process that ignores SIGTERM and one that calls setsid, then exits: both are orphans.
ORPHANS = """
import os, subprocess, sys
out, leftover = sys.argv[1], sys.argv[2]
quiet = dict(stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
for kind in ("stubborn", "setsid"):
    subprocess.Popen([sys.executable, "-c", leftover, f"{out}/pid_{kind}", kind], **quiet)
"""
HOLDER = """
import json, os, subprocess, sys, time
from ddprun import reaper
mode, out, grace = sys.argv[1], sys.argv[2], float(sys.argv[3])
say = lambda text: print(text, file=sys.stderr, flush=True)
with reaper.job_reaper(grace_period_s=grace, say=say) as marker:
    if mode == "obedient":
        subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    else:
        subprocess.run([sys.executable, "-c", ORPHANS, out, LEFTOVER], check=True)
    while mode != "obedient" and not all(os.path.exists(f"{out}/pid_{k}") for k in ("stubborn", "setsid")):
        time.sleep(0.02)
    import psutil
    below = psutil.Process().children(recursive=True)
    record = {"marker": marker, "pids": [p.pid for p in below], "ppids": [p.ppid() for p in below]}
    open(out + "/record", "w").write(json.dumps(record))
    if mode == "hold":
        time.sleep(300)
    started = time.monotonic()
left = [(p.pid, p.status()) for p in psutil.Process().children(recursive=True)]
print(json.dumps({"left": left, "exit_s": time.monotonic() - started}))
"""


@pytest.fixture
def leftovers():
    """Pids a test expects gone; whatever a failing test leaves is killed at teardown."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def holder(mode: str, out: Path, grace: float) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    code = f"ORPHANS = {ORPHANS!r}\nLEFTOVER = {LEFTOVER!r}\n{HOLDER}"
    return subprocess.Popen([sys.executable, "-c", code, mode, str(out), str(grace)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_record(out: Path, *, leftovers: list[int], timeout: float = 30) -> dict:
    """What the holder saw below itself, once it has recorded it; the orphans' own pids go to `leftovers`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError):
            record = json.loads((out / "record").read_text())
            leftovers += [int(f.read_text()) for f in out.glob("pid_*")] + record["pids"]
            return record
        time.sleep(0.05)
    raise AssertionError("the holder never recorded its descendants")


def carrying(marker: str) -> list[int]:
    """Processes with the marker on their command line (the watchdog) or in their environment."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if any(marker in arg for arg in process.cmdline()) or process.environ().get(JOB_MARKER_ENV) == marker:
                found.append(process.pid)
    return found


def still_carrying(marker: str) -> list[int]:
    deadline = time.monotonic() + GONE_WITHIN_S
    while (found := carrying(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_orphans_are_subreaped_then_stopped_and_reaped_when_the_job_ends(tmp_path, leftovers):
    job = holder("leave", tmp_path, grace=1)
    record = wait_for_record(tmp_path, leftovers=leftovers)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert sorted(record["pids"]) == sorted(set(leftovers))  # both orphans, reparented to the holder
    assert record["ppids"] == [job.pid, job.pid]
    assert "ended 2 process(es) the workers left running" in err
    assert json.loads(out)["left"] == []  # none running, no zombie either
    assert wait_gone(leftovers, timeout=GONE_WITHIN_S) == []
    assert still_carrying(record["marker"]) == []  # the watchdog left too


def test_descendants_that_obey_sigterm_do_not_wait_for_the_grace_period(tmp_path, leftovers):
    job = holder("obedient", tmp_path, grace=60)
    record = wait_for_record(tmp_path, leftovers=leftovers)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert json.loads(out)["exit_s"] < 10
    assert wait_gone(leftovers, timeout=GONE_WITHIN_S) == []


def test_kill_9_of_the_launcher_leaves_the_watchdog_to_kill_the_rest(tmp_path, leftovers):
    job = holder("hold", tmp_path, grace=1)
    record = wait_for_record(tmp_path, leftovers=leftovers)
    assert set(carrying(record["marker"])) >= set(leftovers)
    job.kill()
    job.communicate(timeout=60)
    assert wait_gone(leftovers, timeout=GONE_WITHIN_S) == []
    assert still_carrying(record["marker"]) == []


# --- real jobs: 2 workers, each leaving two processes behind ----------------------------------


def start(cpu_env: dict, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        ddprun_command() + ["run", "--grace-period", "2", SCRIPT], env=dict(cpu_env, MODE=mode), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def grandchildren(out: Path, *, ranks: int = 2, timeout: float = 60) -> list[int]:
    """Once every rank has recorded its marker: the pids of what the workers left behind."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(list(out.glob("marker?"))) < ranks:
        time.sleep(0.1)
    files = sorted(out.glob("grandchild_*"))
    assert len(files) == 2 * ranks, f"the workers never started their processes: {files}"
    return [int(f.read_text()) for f in files]


def markers(out: Path) -> set[str]:
    return {f.read_text() for f in out.glob("marker?")}


def assert_nothing_left(out: Path, pids: list[int]) -> None:
    assert wait_gone(pids, timeout=GONE_WITHIN_S) == []
    (marker,) = markers(out)
    assert still_carrying(marker) == []  # the watchdog included


@pytest.mark.parametrize("mode,code", [("ok", 0), ("fail", 1)])
def test_what_the_workers_started_ends_with_the_job(cpu_env, tmp_path, leftovers, mode, code):
    result = run_ddprun(["run", "--grace-period", "2", SCRIPT], env=dict(cpu_env, MODE=mode))
    out = tmp_path / "out"
    leftovers += [int(f.read_text()) for f in out.glob("grandchild_*")]
    assert result.returncode == code, result.stderr[-2000:]
    assert len(leftovers) == 4, leftovers
    assert "ended 4 process(es) the workers left running" in result.stderr
    assert_nothing_left(out, leftovers)


def test_ctrl_c_ends_what_the_workers_started(cpu_env, tmp_path, leftovers):
    job = start(cpu_env, "sleep")
    leftovers += grandchildren(tmp_path / "out")
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 130, err[-2000:]
    assert_nothing_left(tmp_path / "out", leftovers)


def test_kill_9_of_ddprun_ends_what_the_workers_started(cpu_env, tmp_path, leftovers):
    job = start(cpu_env, "sleep")
    leftovers += grandchildren(tmp_path / "out")
    job.kill()
    job.communicate(timeout=60)
    assert_nothing_left(tmp_path / "out", leftovers)
