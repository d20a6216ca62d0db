"""Bad input: one or two lines on stderr, no traceback, exit 2, nothing started."""

from __future__ import annotations

import pytest

from conftest import SCRIPTS, run_ddprun

SCRIPT = str(SCRIPTS / "allreduce.py")


@pytest.mark.parametrize(
    "args,expected",
    [
        (["run", "missing.py"], "missing.py: no such script"),
        (["run", str(SCRIPTS)], "is a directory"),
        (["run", "--gpus", "0", SCRIPT], "--gpus"),
        (["run", "--gpus", "-1", SCRIPT], "--gpus"),
        (["run", "--gpus", "abc", SCRIPT], "--gpus"),
        (["run", "--gpus", "0,0", SCRIPT], "--gpus"),
        (["run", "--nproc", "0", SCRIPT], "--nproc 0"),
        (["run", "--nproc", "two", SCRIPT], "--nproc two"),
        (["run", "--port", "70000", SCRIPT], "70000"),
        (["run", "--port", "abc", SCRIPT], "--port abc"),
        (["run", "--cpu", "--gpus", "1", SCRIPT], "--cpu and --gpus"),
        (["run", "-m", "not a module", SCRIPT], "not a module name"),
        (["run", "--max-restarts", "-1", SCRIPT], "--max-restarts -1"),
        (["run", "--grace-period", "-1", SCRIPT], "--grace-period -1"),
        (["run", "--join-timeout", "0", SCRIPT], "--join-timeout 0"),
        (["run", "--ranks", "0,5", SCRIPT], "outside the world"),
        (["run", "--ranks", "a", SCRIPT], "--ranks a"),
        (["run", "--json", SCRIPT], "--json goes with --dry-run"),
    ],
)
def test_bad_input_exits_2_with_a_short_message(args, expected, cpu_env):
    result = run_ddprun(args, env=cpu_env, timeout=30)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("value", ["0,0", "abc", "0,-1,1", "1.5"])
def test_malformed_cuda_visible_devices(value, cpu_env):
    result = run_ddprun(["run", SCRIPT], env=dict(cpu_env, CUDA_VISIBLE_DEVICES=value), timeout=30)
    assert result.returncode == 2
    assert f'CUDA_VISIBLE_DEVICES="{value}"' in result.stderr
    assert "Traceback" not in result.stderr


def test_log_dir_that_is_a_file(cpu_env, tmp_path):
    file = tmp_path / "file"
    file.write_text("x")
    result = run_ddprun(["run", "--log-dir", str(file), SCRIPT], env=cpu_env, timeout=30)
    assert result.returncode == 2 and "is a file" in result.stderr


def test_taken_port_names_its_holder(cpu_env):
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run_ddprun(["run", "--port", str(port), SCRIPT], env=cpu_env, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"--port {port}: the port is already in use" in result.stderr
    assert "pid" in result.stderr  # what holds it, where the system says
    assert "Traceback" not in result.stderr
