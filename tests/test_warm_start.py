"""Warm start (ranks forked from a per-node server that imported torch once): what a rank sees is
what a fresh interpreter would, faults fall back to fresh processes, and the real-launch and
lifecycle tests pass in this mode too (imported below: they run again with a warm cpu_env).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from conftest import SCRIPTS, run_ddprun

# The launch tests of other files, collected again here: their `cpu_env` is this file's.
from test_lifecycle import (  # noqa: F401
    test_a_stop_signal_stops_everything_in_one_line,
    test_forwarded_preemption_signal_reaches_the_workers,
    test_kill_9_of_ddprun_leaves_no_worker,
    test_log_dir_keeps_every_rank_and_ranks_limits_the_console,
    test_report_exit_code_is_the_workers_own,
    test_report_for_a_rank_killed_by_sigkill_suggests_the_oom_killer,
    test_report_names_the_rank_the_exception_and_the_users_line,
    test_restart_after_a_killed_worker_completes_the_job_and_says_why,
)
from test_lifecycle import start, wait_gone, worker_pids
from test_hangs import (  # noqa: F401  (signals reach a warm rank through its client)
    env,
    test_a_collective_timeout_names_the_rank_outside_the_collective,
    test_stacks_ctrl_backslash_user_sigusr1_then_ctrl_c,
)
from test_torchrun_launch import (  # noqa: F401
    test_a_worker_exit_code_passes_through_except_ddpruns_own_2,
    test_file_per_rank_env_per_rank_absolute_file_and_local_ranks_filter,
    test_in_a_terminal_the_console_rank_gets_the_terminal,
)
from test_run_launch import (  # noqa: F401
    test_every_rank_runs_allreduces_and_gets_its_arguments_unchanged,
    test_module_mode_runs_a_module_from_the_working_directory,
)

SERVER = "ddprun.worker.warmserver"


@pytest.fixture
def cpu_env(cpu_env):
    """conftest's CPU environment, with warm start asked for through its variable."""
    return dict(cpu_env, DDPRUN_WARM_START="1")


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def ranks_seen(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_a_warm_rank_sees_what_a_fresh_interpreter_would(cpu_env, tmp_path):
    script = tmp_path / "sub" / "probe.py"
    script.parent.mkdir()
    script.write_text((SCRIPTS / "fresh_interpreter.py").read_text())
    env = dict(cpu_env, USER_MARK="mine")
    result = run_ddprun(["run", "--cpu", str(script), "--", "a", "--b"], env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    seen = ranks_seen(tmp_path / "out")
    for rank, rank_seen in enumerate(seen):
        assert rank_seen["preloaded"] and SERVER in rank_seen["parent"]  # really warm
        assert rank_seen["argv"] == [str(script), "a", "--b"]
        assert rank_seen["name"] == "__main__" and rank_seen["file"] == str(script)
        assert rank_seen["path0"] == str(script.parent) and rank_seen["cwd"] == str(tmp_path)
        assert rank_seen["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
                                    "USER_MARK": "mine", "DDPRUN_WARM_SOCKET": None}
        assert rank_seen["threads"] == 1
        assert rank_seen["signals"] == {
            "SIGINT": repr(signal.default_int_handler), "SIGTERM": repr(signal.SIG_DFL),
            "SIGPIPE": repr(signal.SIG_IGN), "SIGUSR1": repr(signal.SIG_DFL), "SIGHUP": repr(signal.SIG_DFL),
            "SIGCHLD": repr(signal.SIG_DFL), "SIGXFSZ": repr(signal.SIG_IGN)}
        assert rank_seen["blocked"] == []
    assert seen[0]["random"] != seen[1]["random"]
    assert "[rank 1] hello from 1" in result.stdout
    assert "warm: every rank forked from one server" in " ".join(result.stderr.split())  # the panel says so


def test_the_same_script_fresh_sees_no_server(cpu_env, tmp_path):
    env = dict(cpu_env, DDPRUN_WARM_START="0")
    result = run_ddprun(["run", "--cpu", str(SCRIPTS / "fresh_interpreter.py")], env=env)
    assert result.returncode == 0, result.stderr
    assert "warm:" not in result.stderr
    for rank_seen in ranks_seen(tmp_path / "out"):
        assert not rank_seen["preloaded"] and SERVER not in rank_seen["parent"]


@pytest.mark.parametrize("mode", ["spawn", "fork"])
def test_multiprocessing_in_a_warm_rank(cpu_env, tmp_path, mode):
    result = run_ddprun(["run", "--cpu", str(SCRIPTS / "fresh_interpreter.py")], env=dict(cpu_env, MODE=mode))
    assert result.returncode == 0, result.stderr
    assert [s["children"] for s in ranks_seen(tmp_path / "out")] == [[4], [9]]


def test_a_dead_server_means_one_warning_then_fresh_ranks(cpu_env, tmp_path):
    result = run_ddprun(["run", "--cpu", "--max-restarts", "1", str(SCRIPTS / "server_killer.py")], env=cpu_env)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("warm start unavailable") == 1
    out = tmp_path / "out"
    assert SERVER in (out / "parent1.0").read_text()  # rank 0 may look after the kill
    assert all(SERVER not in (out / f"parent{r}.1").read_text() for r in (0, 1))


def test_a_restart_forks_its_ranks_from_the_same_server(cpu_env, tmp_path):
    result = run_ddprun(["run", "--cpu", "--max-restarts", "1", str(SCRIPTS / "server_killer.py")],
                        env=dict(cpu_env, MODE="self"))
    assert result.returncode == 0, result.stderr
    assert "warm start unavailable" not in result.stderr
    parents = {(tmp_path / "out" / f"parent{r}.{a}").read_text() for r in (0, 1) for a in (0, 1)}
    assert len(parents) == 1 and SERVER in parents.pop()


def test_kill_9_of_ddprun_leaves_no_server(cpu_env, tmp_path):
    scratch = tmp_path / "tmp"
    logs = tmp_path / ("deep" * 20)  # the socket's path is then longer than a Unix socket's 107 bytes
    scratch.mkdir()
    job = start(dict(cpu_env, MODE="sleep", TMPDIR=str(scratch)), "--log-dir", str(logs))
    pids = worker_pids(tmp_path / "out")
    servers = {parent_of(pid) for pid in pids}
    assert all(SERVER in Path(f"/proc/{s}/cmdline").read_text().replace("\0", " ") for s in servers)
    job.kill()
    job.wait()
    assert wait_gone([*pids, *servers], timeout=3) == []
    # Its socket lives in the job's own folder, however deep: nothing of the server's is left elsewhere.
    assert len(os.fsencode(str(next(logs.glob("*/warm.sock"))))) > 107
    assert not [p for p in scratch.iterdir() if p.name.startswith("ddprun")]


def test_the_plan_says_which_mode_and_what_is_preloaded(cpu_env, tmp_path):
    def launch(*args: str, env: dict) -> dict:
        result = run_ddprun([args[0], "--dry-run", "--json", *args[1:]], env=env)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)["launch"]

    fresh = dict(cpu_env)
    fresh.pop("DDPRUN_WARM_START")
    script = str(SCRIPTS / "allreduce.py")
    assert launch("run", script, env=fresh)["warm_start"] is False
    assert launch("run", "--warm-start", script, env=fresh)["warm_preload"] == ["torch", "torch.distributed"]
    from ddprun import torch_internals

    trainer_default = torch_internals.features_for(torch_internals.installed_torch_version()).warm_trainer_by_default
    assert launch("train", "--cpu", env=fresh)["warm_start"] is trainer_default  # on the verified releases
    assert launch("train", "--cpu", env=dict(fresh, DDPRUN_WARM_START="0"))["warm_start"] is False
    assert launch("train", "--cpu", "--warm-start", env=fresh)["warm_preload"][-1] == "ddprun.worker.train"
    assert launch("train", "--cpu", "--fresh-start", env=fresh)["warm_start"] is False
    assert launch("run", "--no-python", "true", env=cpu_env)["warm_start"] is False


def test_the_trainer_trains_warm(cpu_env, tmp_path):
    args = ["train", "--cpu", "--nproc", "2", "--warm-start", "--model", "mlp", "--image-size", "8",
            "--num-classes", "2", "--dataset-size", "64", "--epochs", "1", "--batch-size", "16"]
    result = run_ddprun(args, env=cpu_env, timeout=300)
    assert result.returncode == 0, result.stderr


def test_a_script_that_sets_an_import_time_variable_is_found():
    from ddprun.warmstart import import_time_settings

    source = """import os
os.environ["TORCH_LOGS"] = "+dynamo"
os.environ.setdefault('OMP_NUM_THREADS', '2')
os.environ.update(MKL_NUM_THREADS="1")
os.environ["CUDA_VISIBLE_DEVICES"] = "0"  # read when CUDA starts, in the rank: fine warm
home = os.environ["TORCH_HOME"]
if os.environ["TORCH_X"] == "1": pass
"""
    assert import_time_settings(source) == ["MKL_NUM_THREADS", "OMP_NUM_THREADS", "TORCH_LOGS"]


def test_such_a_script_starts_fresh_with_a_note(cpu_env, tmp_path):
    script = tmp_path / "sets_torch_var.py"
    script.write_text('import os\nos.environ["TORCH_SHOW_CPP_STACKTRACES"] = "1"\n'
                      + (SCRIPTS / "fresh_interpreter.py").read_text())
    result = run_ddprun(["run", "--cpu", str(script)], env=cpu_env)
    assert result.returncode == 0, result.stderr
    assert "sets TORCH_SHOW_CPP_STACKTRACES in os.environ" in " ".join(result.stderr.split())
    assert all(SERVER not in seen["parent"] for seen in ranks_seen(tmp_path / "out"))


def test_a_warm_rank_ends_as_a_fresh_interpreter_does(cpu_env, tmp_path):
    """Threads joined, then atexit, then the user's objects let go, files flushed, stdout too:
    the same files, in the same order, from a warm rank and from a fresh one."""
    seen = {}
    for warm in ("0", "1"):
        out = tmp_path / f"out{warm}"
        result = run_ddprun(["run", "--cpu", str(SCRIPTS / "ending.py")],
                            env=dict(cpu_env, DDPRUN_WARM_START=warm, OUT_DIR=str(out)))
        assert result.returncode == 0, result.stderr
        assert "[rank 1] no newline at the end" in result.stdout
        seen[warm] = {path.name: path.read_text() for path in sorted(out.iterdir())}
    assert seen["1"] == seen["0"]
    assert seen["1"]["ending1.txt"] == "a non-daemon thread\natexit\na global's __del__\n"
    assert seen["1"]["unclosed1.txt"] == "buffered, never closed\n"
    assert seen["1"]["log1.txt"] == "INFO:root:logged\n"


@pytest.mark.parametrize("code, status, printed", [(None, 0, ""), (3, 3, ""), (256, 0, ""), (-1, 255, ""),
                                                    (True, 1, ""), ("no data", 1, "no data\n")])
def test_sys_exit_gives_pythons_exit_code(code, status, printed, capsys):
    from ddprun.worker.warmexit import exit_code

    assert exit_code(code) == status
    assert capsys.readouterr().err == printed


def test_what_the_servers_imports_set_in_the_environment_reaches_the_rank_unless_it_has_its_own():
    from ddprun.worker.warmserver import rank_environment

    set_by_imports = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_me"}
    assert rank_environment({"RANK": "1"}, set_by_imports) == {"RANK": "1", **set_by_imports}
    assert rank_environment({"TORCHINDUCTOR_CACHE_DIR": "/mine"}, set_by_imports) == {"TORCHINDUCTOR_CACHE_DIR": "/mine"}


def test_a_server_whose_imports_loaded_the_cuda_driver_serves_no_rank(tmp_path):
    """Forked after CUDA started, a rank could not use it: the server ends (the launcher then warns
    once and starts fresh ranks). Here a preloaded module maps a library named like the driver."""
    import shutil
    import subprocess
    import sys

    import torch

    library = next(Path(torch.__file__).parent.joinpath("lib").glob("libgomp*.so*"))
    shutil.copy(library, tmp_path / "libcuda.so.1")
    (tmp_path / "starts_cuda.py").write_text(
        f"import ctypes\nctypes.CDLL({str(tmp_path / 'libcuda.so.1')!r})\n")
    server = subprocess.run(
        [sys.executable, "-m", SERVER, "--socket", str(tmp_path / "s"), "--parent-pid", str(os.getpid()),
         "--preload", "starts_cuda"],
        env=dict(os.environ, PYTHONPATH=str(tmp_path)), capture_output=True, text=True, timeout=60)
    assert server.returncode == 3
    assert "CUDA was started while importing" in server.stderr
