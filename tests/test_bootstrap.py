"""ddprun.worker.bootstrap, run as torchrun runs it: a subprocess per rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
LAUNCHER_PID_ENV = "DDPRUN_LAUNCHER_PID"

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux-only")


def bootstrap_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (ERROR_FILE_ENV, LAUNCHER_PID_ENV)}
    env["PYTHONPATH"] = str(REPO)  # the bootstrap's own package; not the user's sys.path[0]
    env.update(extra)
    return env


def bootstrap(
    *args: str, tmp_path: Path, error_file: Path | None = None, timeout: float = 30, **env: str
) -> subprocess.CompletedProcess:
    if error_file is not None:
        env[ERROR_FILE_ENV] = str(error_file)
    return subprocess.run(
        [sys.executable, "-u", "-m", "ddprun.worker.bootstrap", *args],
        cwd=tmp_path, env=bootstrap_env(**env), capture_output=True, text=True, timeout=timeout,
    )


def write(path: Path, code: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(code))
    return path


REPORTER = """
    import json, os, sys
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__}))
"""


# ---------------------------------------------------------------- running the user's code


def test_script_gets_its_args_unchanged_its_dir_on_sys_path_and_runs_as_main(tmp_path):
    script = write(tmp_path / "proj" / "train.py", REPORTER)
    args = ["--gpus", "3", "--", "-m", "x y", "--lr=0.1", ""]
    result = bootstrap(str(script), *args, tmp_path=tmp_path)

    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen == {"argv": [str(script), *args], "path0": str(tmp_path / "proj"), "name": "__main__"}


def test_module_mode_runs_the_module_as_main_with_cwd_on_sys_path(tmp_path):
    write(tmp_path / "pkg" / "__init__.py", "")
    write(tmp_path / "pkg" / "entry.py", REPORTER)
    result = bootstrap("-m", "pkg.entry", "--gpus", "3", "--", "a", tmp_path=tmp_path)

    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["argv"] == [str(tmp_path / "pkg" / "entry.py"), "--gpus", "3", "--", "a"]
    assert seen["name"] == "__main__"
    assert seen["path0"] == str(tmp_path)


def test_missing_arguments_print_usage_and_exit_2(tmp_path):
    for args in ([], ["-m"]):
        result = bootstrap(*args, tmp_path=tmp_path)
        assert result.returncode == 2
        assert "usage:" in result.stderr


# ---------------------------------------------------------------- the error file


def test_exception_is_recorded_in_torchs_format_and_exits_1(tmp_path):
    script = write(tmp_path / "train.py", """
        def forward(x):
            raise ValueError(f"bad shape {x}")
        forward((3, 4))
    """)
    error_file = tmp_path / "error.json"
    before = time.time()
    result = bootstrap(str(script), tmp_path=tmp_path, error_file=error_file)

    assert result.returncode == 1
    # Python's usual traceback on stderr, without the bootstrap's or runpy's frames.
    assert result.stderr.startswith("Traceback (most recent call last):\n")
    assert 'train.py", line 3, in forward' in result.stderr
    assert "ValueError: bad shape (3, 4)" in result.stderr
    assert "bootstrap.py" not in result.stderr and "runpy" not in result.stderr

    data = json.loads(error_file.read_text())
    assert set(data) == {"message"}
    assert data["message"]["message"] == "ValueError: bad shape (3, 4)"
    info = data["message"]["extraInfo"]
    assert set(info) == {"py_callstack", "timestamp", "timestamp_ms"}
    assert info["py_callstack"] == result.stderr
    assert int(info["timestamp"]) == int(info["timestamp_ms"]) // 1000
    assert before - 1 <= int(info["timestamp_ms"]) / 1000 <= time.time() + 1
    assert not list(tmp_path.glob("error.json.*"))  # no temporary file left behind


def test_torchs_own_process_failure_parses_the_error_file(tmp_path):
    pytest.importorskip("torch")
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    script = write(tmp_path / "train.py", "raise KeyError('lr')\n")
    error_file = tmp_path / "error.json"
    result = bootstrap(str(script), tmp_path=tmp_path, error_file=error_file)

    failure = ProcessFailure(local_rank=0, pid=123, exitcode=result.returncode,
                             error_file=str(error_file))
    assert failure.message["message"] == "KeyError: 'lr'"
    assert "raise KeyError('lr')" in failure.message["extraInfo"]["py_callstack"]
    assert isinstance(failure.timestamp, int) and abs(failure.timestamp - time.time()) < 60
    assert failure.exitcode == 1


def test_sys_exit_passes_through_without_a_record(tmp_path):
    script = write(tmp_path / "train.py", "import sys\nprint('bye', file=sys.stderr)\nsys.exit(3)\n")
    error_file = tmp_path / "error.json"
    result = bootstrap(str(script), tmp_path=tmp_path, error_file=error_file)

    assert result.returncode == 3
    assert result.stderr == "bye\n"
    assert not error_file.exists()


def test_sys_exit_zero_and_normal_end_succeed(tmp_path):
    error_file = tmp_path / "error.json"
    for code in ("import sys; sys.exit(0)\n", "x = 1\n", "import sys; sys.exit(None)\n"):
        script = write(tmp_path / "train.py", code)
        assert bootstrap(str(script), tmp_path=tmp_path, error_file=error_file).returncode == 0
    assert not error_file.exists()


def test_os_exit_keeps_its_code(tmp_path):
    script = write(tmp_path / "train.py", "import os\nos._exit(7)\n")
    error_file = tmp_path / "error.json"
    result = bootstrap(str(script), tmp_path=tmp_path, error_file=error_file)
    assert result.returncode == 7
    assert not error_file.exists()


def test_keyboard_interrupt_is_not_recorded_and_ends_like_python(tmp_path):
    script = write(tmp_path / "train.py", "raise KeyboardInterrupt\n")
    error_file = tmp_path / "error.json"
    result = bootstrap(str(script), tmp_path=tmp_path, error_file=error_file)
    assert result.returncode == -signal.SIGINT
    assert not error_file.exists()


def test_an_error_file_the_users_own_record_wrote_is_kept(tmp_path):
    # What torch's @record does inside the script: write the file, then re-raise.
    script = write(tmp_path / "train.py", """
        import json, os
        try:
            raise ValueError("inner")
        except ValueError as e:
            with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fp:
                json.dump({"message": {"message": "ValueError: inner",
                           "extraInfo": {"py_callstack": "theirs", "timestamp": "1"}}}, fp)
            raise
    """)
    error_file = tmp_path / "error.json"
    result = bootstrap(str(script), tmp_path=tmp_path, error_file=error_file)

    assert result.returncode == 1
    assert json.loads(error_file.read_text())["message"]["extraInfo"]["py_callstack"] == "theirs"


def test_a_stale_error_file_is_replaced(tmp_path):
    error_file = tmp_path / "error.json"
    error_file.write_text('{"message": "stale"}')
    script = write(tmp_path / "train.py", "raise RuntimeError('fresh')\n")
    bootstrap(str(script), tmp_path=tmp_path, error_file=error_file)
    assert json.loads(error_file.read_text())["message"]["message"] == "RuntimeError: fresh"


def test_an_unwritable_error_file_does_not_hide_the_exception(tmp_path):
    script = write(tmp_path / "train.py", "raise RuntimeError('real problem')\n")
    result = bootstrap(str(script), tmp_path=tmp_path, error_file=tmp_path / "no" / "error.json")
    assert result.returncode == 1
    assert "could not write error file" in result.stderr
    assert "RuntimeError: real problem" in result.stderr


def test_missing_module_is_recorded(tmp_path):
    error_file = tmp_path / "error.json"
    result = bootstrap("-m", "no_such_module_xyz", tmp_path=tmp_path, error_file=error_file)
    assert result.returncode == 1
    assert "no_such_module_xyz" in json.loads(error_file.read_text())["message"]["message"]


def test_segfault_leaves_a_python_stack_on_stderr(tmp_path):
    script = write(tmp_path / "train.py", "import ctypes\nctypes.string_at(0)\n")
    result = bootstrap(str(script), tmp_path=tmp_path, error_file=tmp_path / "error.json")
    assert result.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in result.stderr
    assert 'train.py", line 2' in result.stderr


def test_bootstrap_does_not_import_torch(tmp_path):
    script = write(tmp_path / "train.py", "import sys\nprint('torch' in sys.modules)\n")
    result = bootstrap(str(script), tmp_path=tmp_path)
    assert result.stdout.strip() == "False"


# ---------------------------------------------------------------- dying with the launcher


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie nobody has reaped yet."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@linux_only
def test_worker_dies_when_its_launcher_is_killed(tmp_path):
    write(tmp_path / "sleep.py", "import time\ntime.sleep(120)\n")
    launcher = write(tmp_path / "launcher.py", f"""
        import os, subprocess, sys, time
        env = dict(os.environ, {LAUNCHER_PID_ENV}=str(os.getpid()))
        child = subprocess.Popen([sys.executable, "-m", "ddprun.worker.bootstrap", "sleep.py"],
                                 env=env)
        print(child.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, str(launcher)], cwd=tmp_path,
                              env=bootstrap_env(), stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        time.sleep(0.5)  # let the worker reach its sleep
        assert alive(worker)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 2
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(worker)
    finally:
        parent.kill()
        parent.wait()
        if "worker" in locals() and alive(worker):
            os.kill(worker, signal.SIGKILL)


@linux_only
def test_worker_whose_launcher_is_already_gone_exits_at_once(tmp_path):
    marker = tmp_path / "ran"
    script = write(tmp_path / "train.py", f"open({str(marker)!r}, 'w').close()\n")
    # A pid that is not our parent: the launcher that started us has died already.
    result = bootstrap(str(script), tmp_path=tmp_path, timeout=10,
                       **{LAUNCHER_PID_ENV: str(os.getpid() + 1_000_000)})
    assert result.returncode == 128 + signal.SIGKILL
    assert not marker.exists()


def test_an_exception_whose_str_fails_still_ends_like_python(tmp_path):
    script = write(tmp_path / "train.py", """
        class Weird(Exception):
            def __str__(self):
                raise RuntimeError("no str")
        raise Weird()
    """)
    result = bootstrap(str(script), tmp_path=tmp_path, error_file=tmp_path / "error.json")
    assert result.returncode == 1
    assert "Weird" in result.stderr
