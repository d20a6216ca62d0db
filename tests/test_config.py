"""Defaults from [tool.ddprun] / ddprun.toml: precedence (flag > DDPRUN_* > file > built-in) on the
--dry-run --json source map, and exit 2 naming the file, line and key for a bad file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import SCRIPTS, run_ddprun
from ddprun import config
from ddprun.errors import UsageError

SCRIPT = str(SCRIPTS / "allreduce.py")
PYPROJECT = """\
[project]
name = "demo"

[tool.ddprun]
cpu = true
nproc = 3
max-restarts = 2
grace_period = 7.5
"""


def _dry_run(args: list[str], *, cwd: Path, env: dict) -> dict:
    result = run_ddprun(["run", "--dry-run", "--json", *args, SCRIPT], env=env, cwd=cwd, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _error(args: list[str], *, cwd: Path, env: dict) -> str:
    result = run_ddprun(["run", "--dry-run", *args, SCRIPT], env=env, cwd=cwd, timeout=60)
    assert result.returncode == 2, (result.stdout, result.stderr)
    return " ".join(result.stderr.split())  # Rich wraps long lines


def test_flag_wins_over_variable_over_file_over_default(tmp_path, cpu_env):
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    here = "pyproject.toml [tool.ddprun]"
    plan = _dry_run([], cwd=tmp_path, env=cpu_env)
    assert (plan["nproc_per_node"], plan["grace_period_s"]) == (3, 7.5)
    assert plan["source"]["nproc"] == f"{here} nproc"
    assert plan["source"]["max_restarts"] == f"{here} max-restarts"
    assert plan["torchrun_args"][plan["torchrun_args"].index("--max-restarts") + 1] == "2"
    assert "keep_logs" not in plan["source"]  # the built-in default: nobody set it

    plan = _dry_run([], cwd=tmp_path, env={**cpu_env, "DDPRUN_NPROC": "4"})
    assert (plan["nproc_per_node"], plan["source"]["nproc"]) == (4, "DDPRUN_NPROC")
    assert plan["source"]["grace_period"] == f"{here} grace_period"

    plan = _dry_run(["--nproc", "1"], cwd=tmp_path, env={**cpu_env, "DDPRUN_NPROC": "4"})
    assert (plan["nproc_per_node"], plan["source"]["nproc"]) == (1, "--nproc")


def test_nearest_file_upward_and_a_command_table_wins(tmp_path, cpu_env):
    (tmp_path / "pyproject.toml").write_text(PYPROJECT + "\n[tool.ddprun.run]\nnproc = 1\n")
    deeper = tmp_path / "src" / "pkg"
    deeper.mkdir(parents=True)
    plan = _dry_run([], cwd=deeper, env=cpu_env)
    assert plan["nproc_per_node"] == 1
    assert plan["source"]["nproc"].endswith("pyproject.toml [tool.ddprun.run] nproc")
    (deeper / "ddprun.toml").write_text("nproc = 2\ncpu = true\n")  # nearer, and ddprun's own file
    plan = _dry_run([], cwd=deeper, env=cpu_env)
    assert (plan["nproc_per_node"], plan["source"]["nproc"]) == (2, "ddprun.toml nproc")


@pytest.mark.parametrize("table, expected", [
    ("nprocs = 2", "pyproject.toml, line 5: nprocs is not an option of any ddprun command; did you mean nproc?"),
    ("cpu = \"yes\"", "pyproject.toml, line 5: cpu = \"yes\": expected true or false"),
    ("nproc = [2, 3]", "pyproject.toml, line 5: nproc = [2, 3]: expected a string or a number"),
    ("nproc = ", "pyproject.toml: invalid TOML: Invalid value (at line 5, column 9)"),
    ("[tool.ddprun.run]\ngrace = 3", "pyproject.toml, line 6: [tool.ddprun.run] grace is not an option of ddprun run"),
    ("nproc = 0", "pyproject.toml [tool.ddprun] nproc=0: the number of processes per node must be at least 1"),
])
def test_a_bad_file_exits_2_naming_file_line_and_key(table, expected, tmp_path, cpu_env):
    (tmp_path / "pyproject.toml").write_text(f"[project]\nname = \"demo\"\n\n[tool.ddprun]\n{table}\n")
    assert expected in _error([], cwd=tmp_path, env=cpu_env)


def test_a_pyproject_without_the_table_is_passed_over(tmp_path, cpu_env):
    (tmp_path / "ddprun.toml").write_text("nproc = 3\ncpu = true\n")
    inner = tmp_path / "project"
    inner.mkdir()
    (inner / "pyproject.toml").write_text("[project]\nname = \"ddprun-user\"\n")
    assert _dry_run([], cwd=inner, env=cpu_env)["nproc_per_node"] == 3


# --- the pure parts ------------------------------------------------------------------------------

SPECS = {
    "run": [config.OptionSpec("nproc", ("nproc", "nproc_per_node"), "value"),
            config.OptionSpec("cpu", ("cpu",), "flag"),
            config.OptionSpec("forward_signal", ("forward_signal",), "multiple")],
    "doctor": [config.OptionSpec("timeout", ("timeout",), "value")],
}


def _config(text: str) -> config.ConfigFile:
    return config.ConfigFile(Path("/p/ddprun.toml"), False, config.tomllib.loads(text), text)


def test_default_map_per_command_with_aliases_and_kinds():
    found = _config("nproc-per-node = 4\ncpu = true\nforward_signal = 'SIGUSR1'\n[doctor]\ntimeout = 30\n")
    assert config.default_map(found, SPECS) == {
        "run": {"nproc": "4", "cpu": True, "forward_signal": ["SIGUSR1"]},
        "doctor": {"timeout": "30"},
    }


def test_key_line_finds_keys_in_their_table():
    text = "[tool.other]\nnproc = 1\n\n[tool.ddprun]\n# comment\n\"nproc\" = 2\n[tool.ddprun.run]\ncpu=true\n"
    assert config.key_line(text, header="[tool.ddprun]", key="nproc") == 6
    assert config.key_line(text, header="[tool.ddprun.run]", key="cpu") == 8
    assert config.key_line(text, header="[tool.ddprun]", key="missing") is None


def test_find_reads_no_further_than_the_nearest_file(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[tool.ddprun]\nnproc = 2\n")
    assert config.find(tmp_path).table == {"nproc": 2}
    (tmp_path / "pyproject.toml").write_text("[tool]\nddprun = 3\n")
    with pytest.raises(UsageError, match=r"\[tool.ddprun\] must be a table"):
        config.find(tmp_path)
