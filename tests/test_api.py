"""The Python API (ddprun.launch, run_script, plan): bad arguments before anything starts, and
real 2-process gloo launches: return values, JobFailed, run_script, KeyboardInterrupt cleanup."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import api_funcs
import ddprun
from conftest import SCRIPTS, TESTS
from ddprun.plan import LaunchPlan


@pytest.fixture
def quiet_env(cpu_env, monkeypatch, tmp_path):
    """This process's environment as cpu_env (no GPU, no DDPRUN_* defaults), logs under tmp_path."""
    for name in list(os.environ):
        if name not in cpu_env:
            monkeypatch.delenv(name)
    for name, value in cpu_env.items():
        monkeypatch.setenv(name, value)
    return tmp_path / "logs"


# --- bad arguments: UsageError, nothing started ------------------------------------------------


@pytest.mark.parametrize("call, message", [
    (lambda logs: ddprun.launch(api_funcs.fail_on_rank_1, nproc=0, cpu=True, log_dir=logs),
     "--nproc 0: the number of processes per node must be at least 1"),
    (lambda logs: ddprun.launch("not a function", cpu=True, log_dir=logs), "is not callable"),
    (lambda logs: ddprun.launch(api_funcs.fail_on_rank_1, gpus=2, cpu=True, log_dir=logs),
     "--cpu and --gpus exclude each other"),
    (lambda logs: ddprun.launch(api_funcs.fail_on_rank_1, nproc="2", log_dir=logs), "nproc='2': expected int"),
    (lambda logs: ddprun.launch(api_funcs.fail_on_rank_1, nprocs=2, log_dir=logs), "unknown option nprocs"),
    (lambda logs: ddprun.run_script("no_such_script.py", cpu=True, log_dir=logs), "no_such_script.py: no such script"),
])
def test_bad_arguments_raise_usage_error_before_anything_starts(call, message, quiet_env):
    with pytest.raises(ddprun.UsageError) as caught:
        call(quiet_env)
    assert message in str(caught.value)
    assert not quiet_env.exists()  # no job folder: nothing started


def test_an_argument_no_rank_can_receive_is_a_usage_error(quiet_env):
    import threading

    with pytest.raises(ddprun.UsageError, match="cannot send 'all_reduce' and its arguments to the ranks"):
        ddprun.launch(api_funcs.all_reduce, threading.Lock(), cpu=True, log_dir=quiet_env)
    assert not quiet_env.exists()


def test_plan_is_the_dry_run(quiet_env):
    plan = ddprun.plan(api_funcs.all_reduce, cpu=True, nproc=3, max_restarts=1, log_dir=quiet_env)
    assert isinstance(plan, LaunchPlan)
    assert (plan.world_size, plan.backend, plan.entrypoint) == (3, "gloo", "-m ddprun.worker.call")
    assert plan.torchrun_args[plan.torchrun_args.index("--max-restarts") + 1] == "1"
    script = ddprun.plan(str(SCRIPTS / "allreduce.py"), ["--x", "1"], cpu=True)
    assert script.entrypoint.endswith("allreduce.py --x 1")
    assert not quiet_env.exists()


def test_the_api_names_and_the_modules_of_the_same_names_both_work():
    from ddprun import launch, plan
    from ddprun.launch import execute

    assert callable(ddprun.launch) and callable(ddprun.plan)
    assert launch.execute is execute and plan.LaunchPlan is LaunchPlan
    assert ddprun.JobFailed.__module__ == "ddprun.api"


def test_import_ddprun_does_not_import_torch_or_the_api():
    code = "import sys, ddprun; print(sorted(m for m in ('torch', 'ddprun.api', 'cloudpickle') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- real launches ------------------------------------------------------------------------------


def test_launch_returns_every_ranks_value_in_rank_order(quiet_env, capfd):
    values = ddprun.launch(api_funcs.all_reduce, 10.0, nproc=2, cpu=True, log_dir=quiet_env)
    assert values == [(0, 30.0, 2), (1, 30.0, 2)]
    job = next(quiet_env.iterdir())
    assert not list(job.glob("*.pkl"))  # the call and the results leave with the job; the logs stay
    assert list(job.glob("attempt_0/rank_1.stdout.log"))
    assert "world         2 = 1 node(s) x 2 process(es), backend gloo" in capfd.readouterr().err


def test_a_rank_that_raises_is_a_job_failed_naming_it(quiet_env):
    with pytest.raises(ddprun.JobFailed) as caught:
        ddprun.launch(api_funcs.fail_on_rank_1, nproc=2, cpu=True, log_dir=quiet_env)
    failed = caught.value
    assert (failed.rank, failed.exc_type, failed.exc_message) == (1, "ValueError", "rank one cannot go on")
    assert failed.user_frame.startswith("tests/api_funcs.py:") or "api_funcs.py:" in failed.user_frame
    assert failed.user_frame.endswith("in fail_on_rank_1")
    assert failed.exit_code == 1
    assert failed.log_dir.startswith(str(quiet_env))
    text = str(failed)
    assert "Rank 1 failed: ValueError: rank one cannot go on" in text
    assert "api_funcs.py:" in text and "ddprun: job failed" in text
    assert isinstance(failed, ddprun.DdprunError)


def test_run_script_returns_0_and_passes_the_arguments(quiet_env, tmp_path):
    out = tmp_path / "out"
    script = tmp_path / "write_rank.py"
    script.write_text("import os, sys\n"
                      "open(os.path.join(sys.argv[1], 'rank_' + os.environ['RANK']), 'w').write(os.environ['WORLD_SIZE'])\n")
    out.mkdir()
    assert ddprun.run_script(str(script), [str(out)], nproc=2, cpu=True, log_dir=quiet_env) == 0
    assert sorted(p.name for p in out.iterdir()) == ["rank_0", "rank_1"]
    assert (out / "rank_1").read_text() == "2"


CALLER = """
import functools, sys, time
sys.path.insert(0, {tests!r})
import api_funcs, ddprun
try:
    ddprun.launch(functools.partial(api_funcs.sleep_forever, {folder!r}, stubborn={stubborn}),
                  nproc=2, cpu=True, grace_period={grace}, log_dir={logs!r})
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
"""


def _interrupted_caller(tmp_path: Path, env: dict, *, stubborn: bool, interrupts: int) -> tuple[str, float, list[int]]:
    """A Python program in ddprun.launch, sent `interrupts` SIGINTs once every rank is up: its
    output, the seconds from the first SIGINT to its exit, and the workers' pids."""
    folder = tmp_path / "pids"
    folder.mkdir()
    code = CALLER.format(tests=str(TESTS), folder=str(folder), stubborn=stubborn, grace=60 if stubborn else 10,
                         logs=str(tmp_path / "logs"))
    caller = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while len(list(folder.iterdir())) < 2 or any(p.stat().st_size == 0 for p in folder.iterdir()):
        assert caller.poll() is None and time.monotonic() < deadline, caller.communicate()
        time.sleep(0.2)
    pids = [int(p.read_text()) for p in folder.iterdir()]
    started = time.monotonic()
    for _ in range(interrupts):
        caller.send_signal(signal.SIGINT)
        time.sleep(1.0)
    out, err = caller.communicate(timeout=60)
    return out + err, time.monotonic() - started, pids


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_keyboard_interrupt_stops_the_workers_and_is_raised(tmp_path, cpu_env):
    output, _, pids = _interrupted_caller(tmp_path, cpu_env, stubborn=False, interrupts=1)
    assert "KeyboardInterrupt" in output, output
    assert "stopped by SIGINT" in output
    assert all(_gone(pid) for pid in pids)


def test_a_second_keyboard_interrupt_kills_workers_that_ignore_the_first(tmp_path, cpu_env):
    output, seconds, pids = _interrupted_caller(tmp_path, cpu_env, stubborn=True, interrupts=2)
    assert "KeyboardInterrupt" in output, output
    assert "again: killed the workers" in output
    assert seconds < 30  # not the 60 s grace period
    assert all(_gone(pid) for pid in pids)
