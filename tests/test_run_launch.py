"""Real launches: 2 CPU processes on gloo through the installed `ddprun` command."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import SCRIPTS, ddprun_command, run_ddprun


def test_every_rank_runs_allreduces_and_gets_its_arguments_unchanged(cpu_env, tmp_path):
    args = ["--gpus", "3", "--nproc", "x y", "--", "-m", "--dry-run"]
    result = run_ddprun(["run", str(SCRIPTS / "allreduce.py"), "--", *args], env=cpu_env)
    assert result.returncode == 0, result.stderr
    outputs = sorted((tmp_path / "out").glob("rank*.txt"))
    assert [p.name for p in outputs] == ["rank0.txt", "rank1.txt"]
    for path in outputs:
        total, world, argv = path.read_text().split(" ", 2)
        assert (float(total), int(world)) == (3.0, 2)  # 1 + 2
        assert eval(argv) == args
    assert "[rank 0] rank 0 sum 3.0" in result.stdout and "[rank 1] rank 1 sum 3.0" in result.stdout
    assert "No GPU found: running 2 CPU processes on gloo" in result.stderr


def test_module_mode_runs_a_module_from_the_working_directory(cpu_env, tmp_path):
    result = run_ddprun(["run", "-m", "allreduce", "a", "--cpu"], env=cpu_env, cwd=SCRIPTS)
    assert result.returncode == 0, result.stderr
    assert "['a', '--cpu']" in (tmp_path / "out" / "rank1.txt").read_text()


def test_concurrent_jobs_all_succeed_and_listen_on_loopback_only(cpu_env, tmp_path):
    """4 jobs at once: none collides on a port, none joins another's store, nothing listens on '*'."""
    jobs = []
    for i in range(4):
        env = dict(cpu_env, OUT_DIR=str(tmp_path / f"job{i}"))
        cmd = ddprun_command() + ["run", "--log-dir", str(tmp_path / f"logs{i}"), str(SCRIPTS / "listeners.py")]
        jobs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for job in jobs:
        _, err = job.communicate(timeout=240)
        assert job.returncode == 0, err
    for i in range(4):
        seen = json.loads((tmp_path / f"job{i}" / "listeners.json").read_text())
        assert seen["sum"] == 2.0  # its own 2 ranks, never another job's
        assert seen["listening"], "expected the stores and gloo to listen"
        outside = [a for a in seen["listening"] if not a.startswith(("127.", "::1:", "::ffff:127."))]
        assert not outside, f"listening outside loopback: {outside}"
