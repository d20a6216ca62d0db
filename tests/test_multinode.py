"""Two `ddprun` processes on this machine act as two nodes on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import subprocess
import time

import pytest

from conftest import SCRIPTS, ddprun_command, run_ddprun

SCRIPT = str(SCRIPTS / "allreduce.py")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def node(env: dict, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        ddprun_command() + ["run", "--cpu", *flags, SCRIPT], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def finish(*nodes: subprocess.Popen) -> list[str]:
    errs = []
    for n in nodes:
        _, err = n.communicate(timeout=180)
        assert n.returncode == 0, err
        errs.append(err)
    return errs


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("style", ["master", "c10d"])
def test_two_nodes_agree_on_world_and_ranks(cpu_env, tmp_path, style, nproc):
    port = free_port()
    if style == "master":
        flags = [["--nnodes", "2", "--node-rank", str(r), "--master", f"127.0.0.1:{port}"] for r in (0, 1)]
    else:
        flags = [["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job7"]] * 2
    nodes = [node(cpu_env, "--nproc", str(nproc), *f) for f in flags]
    finish(*nodes)
    world = 2 * nproc
    files = sorted((tmp_path / "out").glob("rank*.txt"))
    assert [f.name for f in files] == [f"rank{r}.txt" for r in range(world)]  # every global rank once
    for f in files:
        total, size, _ = f.read_text().split(" ", 2)
        assert (float(total), int(size)) == (sum(range(1, world + 1)), world)


def test_a_node_that_never_comes_fails_after_the_join_timeout(cpu_env):
    port = free_port()
    started = time.monotonic()
    result = run_ddprun(
        ["run", "--cpu", "--nproc", "1", "--nnodes", "2", "--node-rank", "0",
         "--master", f"127.0.0.1:{port}", "--join-timeout", "6", SCRIPT],
        env=cpu_env, timeout=120,
    )
    assert result.returncode == 1
    assert "only 1 of 2 nodes joined" in result.stderr and "1 node missing" in result.stderr
    assert "waiting for the nodes at" in result.stderr  # a visible wait, never a silent hang
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 60


def test_the_store_node_checks_its_port_first(cpu_env):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run_ddprun(
            ["run", "--cpu", "--nnodes", "2", "--node-rank", "0", "--master", f"127.0.0.1:{port}", SCRIPT],
            env=cpu_env, timeout=60,
        )
    assert result.returncode == 2
    assert f"--master 127.0.0.1:{port}: the port is already in use" in result.stderr


def dry_json(env: dict, *flags: str) -> dict:
    result = run_ddprun(["run", "--cpu", *flags, "--dry-run", "--json", SCRIPT], env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_STEP_ID": "0",
         "SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_STEP_NUM_TASKS": "3"}


def test_slurm_fills_in_nodes_rank_endpoint_and_id(cpu_env):
    plan = dry_json(dict(cpu_env, **SLURM))
    assert (plan["nnodes"], plan["rdzv_id"], plan["endpoint"]) == ("3", "4242", "gpu07:29500")
    assert plan["world_size"] == 6
    assert plan["source"]["node_rank"] == "SLURM_NODEID"
    assert plan["source"]["endpoint"].startswith("SLURM_")


def test_explicit_flags_win_over_slurm(cpu_env):
    plan = dry_json(dict(cpu_env, **SLURM), "--node-rank", "0", "--rdzv-id", "mine")
    assert (plan["rdzv_id"], plan["source"]["rdzv_id"], plan["source"]["node_rank"]) == ("mine", "--rdzv-id", "--node-rank")
    assert plan["source"]["max_nodes"] == "SLURM_NNODES"


def test_kubeflow_variables(cpu_env):
    env = dict(cpu_env, MASTER_ADDR="job-master-0", MASTER_PORT="23456", WORLD_SIZE="2", RANK="1")
    plan = dry_json(env)
    assert (plan["nnodes"], plan["endpoint"]) == ("2", "job-master-0:23456")
    args = plan["torchrun_args"]
    assert args[args.index("--node-rank") + 1] == "1"
    assert plan["source"]["node_rank"] == "RANK"


def test_sbatch_prints_a_script_that_runs_the_same_command(cpu_env):
    result = run_ddprun(["sbatch", "--nodes", "2", "--gpus-per-node", "4", "--time", "01:00:00",
                         "--partition", "gpu", "--", "train", "--epochs", "3"], env=cpu_env, timeout=30)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for directive in ("--nodes=2", "--gpus-per-node=4", "--time=01:00:00", "--partition=gpu", "--ntasks-per-node=1"):
        assert f"#SBATCH {directive}" in text
    assert text.rstrip().splitlines()[-1].endswith("ddprun train --epochs 3")
    if subprocess.run(["bash", "-c", "true"]).returncode == 0:
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
