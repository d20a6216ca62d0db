"""Hangs, for real: 2 CPU ranks on gloo where rank 1 sleeps instead of calling all_reduce.

`ddprun stacks`, Ctrl-\\ and Ctrl-C show rank 1 in time.sleep and rank 0 in all_reduce; the stall
watch reports (or ends) the job; a collective timeout's panel names rank 1; the user's own SIGUSR1
handler still fires. Each test gets its own per-user root (TMPDIR), so other jobs on the machine
are not "the only running job".
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from importlib import metadata
from pathlib import Path

import pytest

from conftest import SCRIPTS, ddprun_command, run_ddprun

DEADLOCK = SCRIPTS / "deadlock.py"
_SOURCE = DEADLOCK.read_text().splitlines()
SLEEP_LINE = next(i for i, line in enumerate(_SOURCE, 1) if "time.sleep(3600)" in line)
REDUCE_LINE = next(i for i, line in enumerate(_SOURCE, 1) if "dist.all_reduce(t)" in line)
RANK0 = f"rank 0: deadlock.py:{REDUCE_LINE} in <module> -> all_reduce"
RANK1 = f"rank 1: deadlock.py:{SLEEP_LINE} in <module> -> time.sleep"
# torch >= 2.10 leaves SIGQUIT and SIGINT to ddprun (LaunchConfig.signals_to_handle).
TORCH_LETS_DDPRUN_HAVE_SIGQUIT = tuple(int(p) for p in metadata.version("torch").split(".")[:2]) >= (2, 10)


@pytest.fixture
def env(cpu_env, tmp_path):
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    return dict(cpu_env, TMPDIR=str(private_tmp))  # ddprun's per-user root goes in here


class Job:
    def __init__(self, args: list[str], *, env: dict, tmp_path: Path) -> None:
        self.out = Path(env["OUT_DIR"])
        self.stdout, self.stderr = tmp_path / "job.stdout", tmp_path / "job.stderr"
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(ddprun_command() + args, env=env, stdout=out, stderr=err)

    def err(self) -> str:
        return self.stderr.read_text()

    def wait_until(self, ready, *, timeout: float, what: str) -> float:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None, f"the job ended ({self.proc.returncode}) before {what}:\n{self.err()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{self.err()}"
            time.sleep(0.1)
        return time.monotonic()

    def wait_blocked(self) -> float:
        """Both ranks are where the script blocks (rank 0 inside all_reduce a moment later)."""
        at = self.wait_until(lambda: all((self.out / f"ready{r}").exists() for r in (0, 1)), timeout=90,
                             what="ready files")
        time.sleep(1.0)
        return at

    def rank_pid(self, rank: int) -> int:
        [pid_file] = self.out.parent.glob(f"tmp/ddprun-*/ddprun-*/attempt_0/rank_{rank}.pid")
        return int(pid_file.read_text())

    def kill(self) -> None:
        """After a failed assertion: end the job without hiding that assertion."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def finish(self, *, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def test_stacks_ctrl_backslash_user_sigusr1_then_ctrl_c(env, tmp_path):
    job = Job(["run", "--cpu", str(DEADLOCK)], env=env, tmp_path=tmp_path)
    try:
        job.wait_blocked()
        shown = run_ddprun(["stacks"], env=env, timeout=30)
        assert shown.returncode == 0, shown.stderr
        assert RANK0 in shown.stdout and RANK1 in shown.stdout, shown.stdout
        assert shown.stdout.index(RANK0) < shown.stdout.index(RANK1)
        assert "time.sleep(3600)" in shown.stdout  # the user's line under its frame

        os.kill(job.rank_pid(1), signal.SIGUSR1)  # the script's own handler, untouched by ddprun's
        job.wait_until(lambda: (job.out / "usr1_1").exists(), timeout=10, what="the user's SIGUSR1 handler")

        if TORCH_LETS_DDPRUN_HAVE_SIGQUIT:
            job.proc.send_signal(signal.SIGQUIT)
            job.wait_until(lambda: "Ctrl-\\; the job keeps running" in job.err() and RANK1 in job.err(),
                           timeout=10, what="stacks after SIGQUIT")
            time.sleep(0.5)
            assert job.proc.poll() is None, "SIGQUIT stopped the job"
        job.proc.send_signal(signal.SIGINT)
        assert job.finish() == 130
    finally:
        job.kill()
    err = job.err()
    if TORCH_LETS_DDPRUN_HAVE_SIGQUIT:  # an older torch takes SIGINT itself at each start (ddprun.stall)
        interrupted = err[err.index("interrupted; where every rank was:"):]
        assert RANK0 in interrupted and RANK1 in interrupted, err
    assert "stopped by SIGINT" in err
    exits = sorted(p.read_text().strip() for p in Path(env["TMPDIR"]).glob("ddprun-*/ddprun-*/attempt_0/rank_*.exit"))
    assert exits == ["-2", "-2"]  # the launcher recorded both ranks' ends (killed by SIGINT)
    ended = run_ddprun(["stacks"], env=env, timeout=30)
    assert ended.returncode == 2 and "no running ddprun job" in ended.stderr


def test_stall_timeout_kill_reports_the_stall_naming_rank_1_then_exits_1(env, tmp_path):
    job = Job(["run", "--cpu", "--stall-timeout", "10", "--on-stall", "kill", str(DEADLOCK)], env=env, tmp_path=tmp_path)
    try:
        blocked = job.wait_blocked() - 1.0
        stalled = job.wait_until(lambda: "stalled" in job.err(), timeout=40, what="a stall report")
        assert stalled - blocked < 20, f"the stall was reported {stalled - blocked:.1f} s after the ranks blocked"
        assert job.finish() == 1
    finally:
        job.kill()
    err = job.err()
    report = err[err.index("stalled: no rank has advanced"):]
    assert RANK1 in report and RANK0 in report
    assert "stopped: the job stalled (--on-stall kill)" in err
    assert err.count("stalled: no rank has advanced") == 1


def test_a_collective_timeout_names_the_rank_outside_the_collective(env, tmp_path):
    result = run_ddprun(["run", "--cpu", str(DEADLOCK), "10"], env=env, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "Rank 0 failed" in result.stderr and "Timed out" in result.stderr
    assert f"Likely cause: {RANK1} (not inside a collective)" in result.stderr, result.stderr


def test_stall_report_from_the_environment_keeps_waiting(env, tmp_path):
    """DDPRUN_STALL_TIMEOUT sets it; report mode prints once and leaves the job alone (here the
    process group's own 12 s timeout ends it)."""
    result = run_ddprun(["run", "--cpu", str(DEADLOCK), "12"], env=dict(env, DDPRUN_STALL_TIMEOUT="3"), timeout=120)
    assert result.returncode == 1, result.stderr
    err = result.stderr
    assert err.count("stalled: no rank has advanced") == 1 and "still waiting" in err
    assert err.index("still waiting") < err.index("Rank 0 failed")
    assert f"Likely cause: {RANK1}" in err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_a_bad_stall_timeout_exits_2(value, env):
    result = run_ddprun(["run", "--cpu", f"--stall-timeout={value}", str(DEADLOCK)], env=env, timeout=30)
    assert result.returncode == 2 and f"--stall-timeout {value}:" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_stacks_without_a_running_job_or_with_an_unknown_one_exits_2(env):
    for args, expected in ((["stacks"], "no running ddprun job of yours"),
                           (["stacks", "ddprun-0123456789ab"], "ddprun-0123456789ab: no such job")):
        result = run_ddprun(args, env=env, timeout=30)
        assert result.returncode == 2 and expected in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) <= 2 and "Traceback" not in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_stacks_of_another_user_s_job_exits_2(env, tmp_path):
    import pwd

    nobody = pwd.getpwnam("nobody")
    job = tmp_path / "ddprun-0123456789ab"
    job.mkdir()
    (job / ".ddprun-job").write_text('{"pid": 1, "host": "x", "started": 0}')
    for path in (job, job / ".ddprun-job"):
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    result = run_ddprun(["stacks", str(job)], env=env, timeout=30)
    assert result.returncode == 2 and "belongs to another user" in result.stderr, result.stderr
    assert re.search(r"uid \d+", result.stderr)
