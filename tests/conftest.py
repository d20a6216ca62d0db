"""Shared fixtures: the installed `ddprun` command, a CPU-only environment, tiny worker scripts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
SCRIPTS = TESTS / "scripts"


def ddprun_command() -> list[str]:
    """The installed console script, next to this interpreter (a venv's bin/) or on PATH."""
    beside = Path(sys.executable).with_name("ddprun")
    found = str(beside) if beside.exists() else shutil.which("ddprun")
    if not found:
        pytest.fail("the ddprun command is not installed: pip install -e '.[test]'")
    return [found]


@pytest.fixture(scope="session")
def ddprun() -> list[str]:
    return ddprun_command()


@pytest.fixture
def cpu_env(tmp_path: Path) -> dict[str, str]:
    """An environment in which no GPU exists (a stub-free PATH entry first, no CUDA_VISIBLE_DEVICES)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DDPRUN_", "SLURM_", "PET_"))}
    for name in ("CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "OMP_NUM_THREADS"):
        env.pop(name, None)
    env["OUT_DIR"] = str(tmp_path / "out")
    env["PYTHONUNBUFFERED"] = "1"
    env["COLUMNS"] = "200"  # Rich wraps at 80 columns off a terminal; keep paths on one line
    return env


def run_ddprun_on_a_terminal(args: list[str], *, env: dict[str, str], cwd: Path | None = None) -> tuple[int, str]:
    """`ddprun ARGS` with a pseudo-terminal as its stdin, stdout and stderr: (exit code, all it wrote)."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child
        if cwd is not None:
            os.chdir(cwd)
        os.execve(ddprun_command()[0], ddprun_command() + args, env)
    output = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the terminal's last writer is gone
            break
        if not chunk:
            break
        output += chunk
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), output.decode(errors="replace")


def run_ddprun(args: list[str], *, env: dict[str, str], timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ddprun_command() + args, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
    )


# Runs the CLI in-process as `ddprun ARGS`, then says on stderr which heavy modules it imported.
_IMPORT_PROBE = """
import sys
from ddprun.cli import main
sys.argv = ["ddprun", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
print("TORCH" if "torch" in sys.modules else "NO-TORCH", file=sys.stderr)
print("PSUTIL" if "psutil" in sys.modules else "NO-PSUTIL", file=sys.stderr)
"""


def heavy_imports(args: list[str], *, env: dict[str, str]) -> list[str]:
    """Which of torch and psutil a `ddprun ARGS` call imported (the probe's last two lines)."""
    result = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, *args], env=env,
                            capture_output=True, text=True, timeout=60)
    tail = result.stderr.strip().splitlines()[-2:]
    assert tail and tail[-1].endswith("PSUTIL"), result.stderr
    return [name for name in ("TORCH", "PSUTIL") if name in tail]

