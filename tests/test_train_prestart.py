"""`ddprun train` refuses a bad run before any worker starts: exit 2, one or two lines, nothing launched.

None of these start a process group; the launches at the end check what reaches the failure panel
when a rank (any rank) finds the input bad."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import ddprun_command, run_ddprun

REPO = Path(__file__).resolve().parents[1]


def refused(result: subprocess.CompletedProcess, needle: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert needle in " ".join(result.stderr.split()), result.stderr  # Rich may wrap a long line
    assert "Traceback" not in result.stderr and "[rank" not in result.stderr  # no worker said anything
    assert len(result.stderr.strip().splitlines()) <= 3, result.stderr


@pytest.mark.parametrize("args, needle", [
    (["--lr=nan"], "--lr nan is invalid: it must be a finite number"),
    (["--lr=inf"], "--lr inf is invalid"),
    (["--log-interval=nan"], "--log-interval nan is invalid"),
    (["--collective-timeout=nan"], "--collective-timeout nan is invalid"),
    (["--collective-timeout=inf"], "--collective-timeout inf is invalid"),
    (["--bucket-cap-mb=nan"], "--bucket-cap-mb nan is invalid"),
    (["--weight-decay=nan"], "--weight-decay nan is invalid"),
    (["--label-smoothing=1"], "--label-smoothing 1.0 is invalid"),
    (["--clip-grad-norm=-1"], "--clip-grad-norm -1.0 is invalid"),
    (["--save-every", "soon"], "--save-every soon is invalid"),
    (["--lr-schedule", "linear"], "--lr-schedule 'linear' is not one of: cosine, step, constant"),
    (["--warmup-epochs", "1"], "--warmup-epochs 1 is not shorter than the run"),
])
def test_bad_numbers_and_choices(cpu_env, args, needle):
    refused(run_ddprun(["train", "--cpu"] + args, env=cpu_env), needle)


def test_checkpoint_dir_under_a_file(cpu_env, tmp_path):
    (tmp_path / "file").write_text("")
    refused(run_ddprun(["train", "--cpu", "--checkpoint-dir", str(tmp_path / "file" / "ck")], env=cpu_env),
            f"{tmp_path / 'file'} is a file, not a folder")


def test_resume_without_a_checkpoint(cpu_env, tmp_path):
    refused(run_ddprun(["train", "--cpu", "--resume", "--checkpoint-dir", str(tmp_path)], env=cpu_env),
            f"--resume: no checkpoint at {tmp_path / 'last.pt'}")


def test_empty_data_folder(cpu_env, tmp_path):
    refused(run_ddprun(["train", "--cpu", "--data", str(tmp_path)], env=cpu_env), "has no class folders")


@pytest.fixture
def shared_dir():
    """A folder the user nobody can reach (pytest's tmp_path is private to root)."""
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("switching to the user nobody needs root and setpriv")
    folder = Path(tempfile.mkdtemp(prefix="ddprun-prestart-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def as_nobody(args: list[str], env: dict) -> subprocess.CompletedProcess:
    prefix = ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups"]
    probe = subprocess.run(prefix + [sys.executable, "-c", "import ddprun.cli"], env=env, cwd=REPO,
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("the user nobody cannot run this interpreter")
    return subprocess.run(prefix + [sys.executable, "-m", "ddprun"] + args, env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_read_only_checkpoint_dir(cpu_env, shared_dir):
    """Before: the epoch was trained, then lost at the first save, rank 1 stuck in a barrier."""
    read_only = shared_dir / "ck"
    read_only.mkdir(mode=0o555)
    cpu_env["HOME"] = str(shared_dir)
    refused(as_nobody(["train", "--cpu", "--checkpoint-dir", str(read_only)], cpu_env),
            f"--checkpoint-dir {read_only}: {read_only} is not writable by you")
    refused(as_nobody(["train", "--cpu", "--checkpoint-dir", str(read_only / "run")], cpu_env),
            f"--checkpoint-dir {read_only / 'run'}: {read_only} is not writable by you")


def test_unreadable_data_folder(cpu_env, shared_dir):
    (shared_dir / "data" / "train" / "cat").mkdir(parents=True)
    (shared_dir / "data" / "train" / "cat" / "0.png").write_bytes(b"")
    (shared_dir / "data" / "train" / "cat").chmod(0o700)  # root's: nobody cannot list it
    cpu_env["HOME"] = str(shared_dir)
    refused(as_nobody(["train", "--cpu", "--data", str(shared_dir / "data")], cpu_env),
            f"{shared_dir / 'data' / 'train' / 'cat'} is not readable")


def test_every_rank_reports_a_bad_checkpoint(cpu_env, tmp_path):
    """A truncated last.pt: both ranks refuse it, each with the one-line reason, so whichever rank exits
    first, the failure panel shows why (it used to show only "rank 1 exited with code 2")."""
    (tmp_path / "last.pt").write_bytes(b"PK\x03\x04 half a zip")
    result = run_ddprun(["train", "--cpu", "--nproc", "2", "--model", "mlp", "--image-size", "8",
                         "--checkpoint-dir", str(tmp_path), "--resume"], env=cpu_env)
    assert result.returncode == 2, result.stderr[-3000:]
    # The panel gives the reason whichever rank failed first; a rank stopped before it read the
    # file has no line of its own, so the console is not required to show both.
    panel = " ".join(result.stderr.split("job failed", 1)[-1].split())
    assert f"ddprun train: error: checkpoint {tmp_path / 'last.pt'} is corrupt" in panel, result.stderr
    assert "Traceback" not in result.stderr
