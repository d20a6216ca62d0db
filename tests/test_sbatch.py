"""The sbatch script ddprun writes: directives, quoting, and that bash can parse it."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

from ddprun.errors import UsageError
from ddprun.sbatch import render_sbatch


def render(**overrides) -> str:
    kwargs = dict(nodes=2, gpus_per_node=8, ddprun_args=["train", "--gpus", "8"])
    kwargs.update(overrides)
    return render_sbatch(**kwargs)


def directives(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


def srun_line(script: str) -> str:
    (line,) = [line for line in script.splitlines() if line.startswith("srun ")]
    return line


def usage_error(**overrides) -> str:
    with pytest.raises(UsageError) as info:
        render(**overrides)
    assert "e.g." in info.value.message
    return info.value.message


def test_minimal_script():
    script = render()
    assert script.startswith("#!/bin/bash\n")
    assert script.endswith("\n")
    assert directives(script) == [
        "#SBATCH --job-name=ddprun",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --output=%x-%j.out",
    ]
    assert "set -euo pipefail" in script
    assert srun_line(script) == "srun --ntasks-per-node=1 --kill-on-bad-exit=1 ddprun train --gpus 8"


def test_directives_come_before_any_command():
    # sbatch stops reading #SBATCH lines at the first command.
    lines = render(time="1:00:00").splitlines()
    last_directive = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    first_command = min(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert last_directive < first_command


def test_all_options():
    script = render(
        nodes=4,
        gpus_per_node=4,
        job_name="resnet",
        time="1-12:00:00",
        partition="gpu",
        account="proj42",
        cpus_per_task=32,
        output="logs/%x-%j.log",
    )
    assert directives(script) == [
        "#SBATCH --job-name=resnet",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --time=1-12:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj42",
        "#SBATCH --output=logs/%x-%j.log",
    ]
    assert srun_line(script).startswith("srun --ntasks-per-node=1 --cpus-per-task=32 --kill-on-bad-exit=1 ddprun ")


def test_cpu_only_job_has_no_gpu_directive():
    script = render(gpus_per_node=0)
    assert not any("gpus" in line for line in directives(script))


def test_the_command_carries_no_node_flags():
    line = srun_line(render())
    for flag in ("--nnodes", "--node-rank", "--master", "--rdzv"):
        assert flag not in line


def test_arguments_are_shell_quoted():
    args = ["run", "my script.py", "--", "--name", "it's", "$HOME", "a;b", "*.txt", ""]
    line = srun_line(render(ddprun_args=args))
    command = line.split(" ddprun ", 1)[1]
    assert shlex.split(command) == args
    assert "'my script.py'" in line


@pytest.mark.parametrize("time", ["30", "0", "90", "30:00", "04:00:00", "100:00:00", "2-12", "2-12:30", "2-12:30:00"])
def test_time_forms_slurm_accepts(time):
    assert f"#SBATCH --time={time}" in directives(render(time=time))


@pytest.mark.parametrize("time", ["", "1h", "1:2:3:4", "1-", "-1", "1-2-3", "1:00 ", "one", "1.5", "1-2:3:4:5"])
def test_bad_time(time):
    message = usage_error(time=time)
    assert "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS" in message
    assert "--time 04:00:00" in message


@pytest.mark.parametrize(
    "overrides, shown",
    [
        (dict(nodes=0), "--nodes 0"),
        (dict(nodes=-2), "--nodes -2"),
        (dict(nodes=True), "--nodes True"),
        (dict(nodes="2"), "--nodes 2"),
        (dict(gpus_per_node=-1), "--gpus-per-node -1"),
        (dict(cpus_per_task=0), "--cpus-per-task 0"),
    ],
)
def test_bad_counts(overrides, shown):
    message = usage_error(**overrides)
    assert message.startswith(shown + ":")
    assert f"e.g. {shown.split()[0]} " in message


@pytest.mark.parametrize(
    "overrides, flag",
    [
        (dict(job_name="my job"), "--job-name"),
        (dict(job_name=""), "--job-name"),
        (dict(partition="gpu\n#SBATCH --x"), "--partition"),
        (dict(account="a'b"), "--account"),
        (dict(output="my logs/%j.out"), "--output"),
    ],
)
def test_directive_values_must_be_one_word(overrides, flag):
    message = usage_error(**overrides)
    assert message.startswith(flag)
    assert "one word" in message


def test_empty_command_is_refused():
    message = usage_error(ddprun_args=[])
    assert "no ddprun command" in message


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
@pytest.mark.parametrize(
    "args",
    [["train", "--gpus", "8"], ["run", "it's a file.py", "--", "--x", '"quoted"', "$(rm -rf /)", "`id`", "a\nb"]],
)
def test_bash_parses_the_script(args):
    script = render(ddprun_args=args, time="10:00", partition="gpu", cpus_per_task=4)
    result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")
def test_bash_passes_the_arguments_through_unchanged(tmp_path):
    # Run the script with `srun` replaced by a stub that prints what it was given.
    args = ["run", "it's a file.py", "--", "$HOME", "a b", "*", ""]
    stub = tmp_path / "srun"
    stub.write_text('#!/bin/bash\nfor a in "$@"; do printf "%s\\0" "$a"; done\n')
    stub.chmod(0o755)
    script = render(ddprun_args=args)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    result = subprocess.run(["bash", "-c", script], capture_output=True, env=env, check=True)
    printed = result.stdout.decode().split("\0")[:-1]
    assert printed == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "ddprun", *args]
