"""No orphans, clean signals, the failure report, logs and restarts: real 2-process CPU jobs."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import SCRIPTS, ddprun_command, run_ddprun

SCRIPT = str(SCRIPTS / "lifecycle.py")


def start(env: dict, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        ddprun_command() + ["run", *extra, SCRIPT], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def worker_pids(out: Path, n: int = 2, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(out.glob("pid*"))
        if len(files) >= n:
            time.sleep(0.3)
            return [int(f.read_text()) for f in files]
        time.sleep(0.1)
    raise AssertionError("the workers never started")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(map(alive, pids)):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_kill_9_of_ddprun_leaves_no_worker(cpu_env, tmp_path):
    job = start(dict(cpu_env, MODE="sleep"))
    pids = worker_pids(tmp_path / "out")
    job.kill()
    job.wait()
    assert wait_gone(pids, timeout=3) == []


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_stops_everything_in_one_line(cpu_env, tmp_path, sig, code):
    job = start(dict(cpu_env, MODE="sleep"))
    pids = worker_pids(tmp_path / "out")
    job.send_signal(sig)
    _, err = job.communicate(timeout=60)
    assert job.returncode == code
    assert "Traceback" not in err
    assert f"ddprun: stopped by {sig.name}" in err
    assert err.count("stopped by") == 1, err
    assert wait_gone(pids, timeout=3) == []


def test_a_second_ctrl_c_kills_at_once(cpu_env, tmp_path):
    job = start(dict(cpu_env, MODE="stubborn"), "--grace-period", "60")
    pids = worker_pids(tmp_path / "out")
    job.send_signal(signal.SIGINT)
    time.sleep(1)
    assert job.poll() is None  # still in its 60 s grace period
    started = time.monotonic()
    job.send_signal(signal.SIGINT)
    _, err = job.communicate(timeout=30)
    assert time.monotonic() - started < 5
    assert job.returncode == 130
    assert "Traceback" not in err
    assert wait_gone(pids, timeout=3) == []


def attempt_dir(logs: Path, number: int = 0) -> Path:
    """`--log-dir DIR` keeps a job's files in DIR/<job id>/attempt_N (one job per DIR here)."""
    jobs = list(logs.glob("ddprun-*"))
    assert len(jobs) <= 1, jobs
    return (jobs[0] if jobs else logs / "ddprun-not-yet") / f"attempt_{number}"


def report(cpu_env, tmp_path, mode: str, *extra: str) -> subprocess.CompletedProcess:
    return run_ddprun(["run", "--log-dir", str(tmp_path / "logs"), *extra, SCRIPT], env=dict(cpu_env, MODE=mode))


def test_report_names_the_rank_the_exception_and_the_users_line(cpu_env, tmp_path):
    result = report(cpu_env, tmp_path, "raise")
    assert result.returncode == 1
    err = result.stderr
    assert "Rank 1 failed: ValueError: corrupt sample in batch 3" in err
    assert "lifecycle.py:" in err and "in load_batch" in err
    assert "stderr line from rank 1" in err  # the rank's last lines
    assert str(tmp_path / "logs") in err
    assert "ChildFailedError" not in err and "error_file" not in err


def test_report_exit_code_is_the_workers_own(cpu_env, tmp_path):
    result = report(cpu_env, tmp_path, "exit3")
    assert result.returncode == 3
    assert "Rank 1" in result.stderr and "exit code 3" in result.stderr


def test_report_for_a_rank_killed_by_sigkill_suggests_the_oom_killer(cpu_env, tmp_path):
    result = report(cpu_env, tmp_path, "sigkill")
    assert result.returncode == 1
    assert "SIGKILL" in result.stderr and "out-of-memory killer" in result.stderr


def test_log_dir_keeps_every_rank_and_ranks_limits_the_console(cpu_env, tmp_path):
    result = report(cpu_env, tmp_path, "ok", "--ranks", "1")
    assert result.returncode == 0, result.stderr
    attempt = attempt_dir(tmp_path / "logs")
    for rank in (0, 1):
        assert f"stdout line from rank {rank}" in (attempt / f"rank_{rank}.stdout.log").read_text()
        assert f"stderr line from rank {rank}" in (attempt / f"rank_{rank}.stderr.log").read_text()
    assert "[rank 1] stdout line from rank 1" in result.stdout
    assert "rank 0" not in result.stdout and "[rank 0]" not in result.stderr


def test_restart_after_a_killed_worker_completes_the_job_and_says_why(cpu_env, tmp_path):
    result = report(cpu_env, tmp_path, "die_once", "--max-restarts", "1")
    assert result.returncode == 0, result.stderr
    assert "restart 1/1: rank 1 was killed by SIGKILL" in result.stderr
    assert (attempt_dir(tmp_path / "logs", 1) / "rank_1.stdout.log").exists()
    assert (tmp_path / "out" / "pid1.1").exists()


def test_forwarded_preemption_signal_reaches_the_workers(cpu_env, tmp_path):
    job = start(dict(cpu_env, MODE="preempt"), "--forward-signal", "SIGUSR1")
    worker_pids(tmp_path / "out")
    job.send_signal(signal.SIGUSR1)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert sorted(p.name for p in (tmp_path / "out").glob("preempted*")) == ["preempted0", "preempted1"]


def test_a_rank_stuck_in_training_becomes_an_error_naming_it(cpu_env, tmp_path):
    """Rank 1 freezes (SIGSTOP) mid-training: the job fails after the collective timeout, naming rank 1."""
    logs = tmp_path / "logs"
    job = subprocess.Popen(
        ddprun_command() + ["train", "--cpu", "--nproc", "2", "--log-dir", str(logs), "--grace-period", "2",
                            "--model", "mlp", "--image-size", "16", "--dataset-size", "100000", "--batch-size", "8",
                            "--collective-timeout", "5", "--log-interval", "0.2"],
        env=cpu_env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and " loss " not in _read(attempt_dir(logs) / "rank_0.stderr.log"):
        time.sleep(0.1)
    os.kill(int((attempt_dir(logs) / "rank_1.pid").read_text()), signal.SIGSTOP)
    _, err = job.communicate(timeout=120)
    assert job.returncode != 0
    assert "rank 1 did not answer" in err, err[-2000:]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""
