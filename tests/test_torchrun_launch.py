"""Real launches of torchrun command lines under `ddprun run` (2 CPU processes on gloo): the checks of
torch's own launcher tests (test/distributed/launcher/test_run.py: a file per rank, the environment each
rank sees, a failing worker), the seed's command twice at once, and the rows of issue 17 that need a launch."""

from __future__ import annotations

import json
import socket
import subprocess
import textwrap
import time
from pathlib import Path

from conftest import ddprun_command, run_ddprun, run_ddprun_on_a_terminal

SEED = ["--nproc_per_node=2", "--nnodes=1", "--rdzv_id=123", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:29500"]

ENV_SCRIPT = textwrap.dedent("""
    import json, os, sys
    out = os.environ["OUT_DIR"]; os.makedirs(out, exist_ok=True)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_NAME", "MASTER_ADDR",
             "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")
    seen = {n: os.environ.get(n) for n in names}
    seen.update(file=__file__, argv0=sys.argv[0], args=sys.argv[1:], tty=[sys.stdin.isatty(), sys.stdout.isatty()])
    open(f"{out}/rank{seen['RANK']}.json", "w").write(json.dumps(seen))
    print("hello from", seen["RANK"])
    code = int(os.environ.get("EXIT_RANK1", "0"))
    sys.exit(code if seen["RANK"] == "1" else 0)
""")


def _script(tmp_path: Path, text: str = ENV_SCRIPT, name: str = "envcheck.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _seen(tmp_path: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in (tmp_path / "out").glob("rank*.json")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_file_per_rank_env_per_rank_absolute_file_and_local_ranks_filter(cpu_env, tmp_path):
    _script(tmp_path)
    result = run_ddprun(["run", "--nproc-per-node=2", "--role", "trainer", "--local_ranks_filter=1", "envcheck.py",
                         "--lr", "0.1"], env=cpu_env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    seen = _seen(tmp_path)
    assert sorted(seen) == [0, 1]
    for rank, env in seen.items():
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(rank), str(rank), "2", "2")
        assert env["ROLE_NAME"] == "trainer" and env["GROUP_RANK"] == "0" and env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"]
        assert env["file"] == str(tmp_path / "envcheck.py") and env["argv0"] == "envcheck.py"  # as torchrun
        assert env["args"] == ["--lr", "0.1"] and env["tty"] == [False, False]
    assert "hello from 1" in result.stdout and "hello from 0" not in result.stdout  # local rank 1 only


def test_a_worker_exit_code_passes_through_except_ddpruns_own_2(cpu_env, tmp_path):
    _script(tmp_path)
    result = run_ddprun(["run", "--nproc_per_node", "2", "envcheck.py"], env=dict(cpu_env, EXIT_RANK1="2"), cwd=tmp_path)
    assert result.returncode == 1, result.stderr  # 2 is reserved for "bad input, nothing started"
    assert "rank 1" in result.stderr
    result = run_ddprun(["run", "--nproc_per_node", "2", "envcheck.py"], env=dict(cpu_env, EXIT_RANK1="3"), cwd=tmp_path)
    assert result.returncode == 3, result.stderr


def test_seed_command_twice_at_once_gives_two_successful_jobs(cpu_env, tmp_path):
    jobs = []
    for i in range(2):
        env = dict(cpu_env, OUT_DIR=str(tmp_path / f"job{i}"))
        cmd = ddprun_command() + ["run", *SEED, str(Path(__file__).parent / "scripts" / "allreduce.py")]
        jobs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        time.sleep(0.5)  # the second starts while the first holds the port
    errs = []
    for job in jobs:
        _, err = job.communicate(timeout=240)
        errs.append(err)
        assert job.returncode == 0, err
    for i in range(2):
        assert sorted(p.name for p in (tmp_path / f"job{i}").iterdir()) == ["rank0.txt", "rank1.txt"]
        assert (tmp_path / f"job{i}" / "rank0.txt").read_text().startswith("3.0 2 ")  # its own 2 ranks
    assert any("is in use, so this job's store holds port" in e for e in errs), errs


def test_master_port_is_the_port_the_script_can_use_with_tcp_init(cpu_env, tmp_path):
    port = _free_port()
    _script(tmp_path, textwrap.dedent(f"""
        import os, torch, torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://localhost:{port}",
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        t = torch.ones(1); dist.all_reduce(t)
        assert os.environ["MASTER_PORT"] == "{port}", os.environ["MASTER_PORT"]
        print("sum", t.item())
        dist.destroy_process_group()
    """), name="tcp.py")
    result = run_ddprun(["run", "--nproc_per_node=2", f"--master_port={port}", "tcp.py"], env=cpu_env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("sum 2.0") == 2


def test_no_python_executes_a_program_after_the_worker_setup(cpu_env, tmp_path):
    program = tmp_path / "job.sh"
    program.write_text('#!/bin/sh\nmkdir -p "$OUT_DIR"\necho "$RANK $1" > "$OUT_DIR/rank$RANK.txt"\n')
    program.chmod(0o755)
    result = run_ddprun(["run", "--no-python", "--nproc-per-node", "2", "./job.sh", "x"], env=cpu_env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted((tmp_path / "out" / f"rank{r}.txt").read_text() for r in (0, 1)) == ["0 x\n", "1 x\n"]


def test_elastic_one_node_of_two_starts_after_last_call_timeout(cpu_env, tmp_path):
    _script(tmp_path)
    began = time.monotonic()
    result = run_ddprun(["run", "--nnodes", "1:2", f"--rdzv-endpoint=localhost:{_free_port()}", "--nproc_per_node=2",
                         "--rdzv-conf", "last_call_timeout=1", "envcheck.py"], env=cpu_env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - began < 25  # not torch's default 30 s wait for a second node
    assert sorted(_seen(tmp_path)) == [0, 1]


def test_in_a_terminal_the_console_rank_gets_the_terminal(cpu_env, tmp_path):
    _script(tmp_path)
    code, text = run_ddprun_on_a_terminal(["run", "--nproc_per_node=2", "envcheck.py"], env=cpu_env, cwd=tmp_path)
    assert code == 0, text
    seen = _seen(tmp_path)
    assert seen[0]["tty"] == [True, True] and seen[1]["tty"][1] is False
    assert "hello from 0" in text and "[rank 1] hello from 1" in text and "[rank 0] hello from 0" not in text
    assert "\x1b[2K" not in text  # no live display (for the trainer's bar only) clears rank 0's lines
