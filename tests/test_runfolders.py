"""Where a job's files go on a shared machine: the per-user root, job folders, retention, and
real launches by two users (root and `nobody`) sharing one temp dir."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

from conftest import SCRIPTS, ddprun_command, run_ddprun
from ddprun import runfolders
from ddprun.errors import UsageError

UID = os.getuid()
SCRIPT = str(SCRIPTS / "allreduce.py")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def nobody() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this machine")


def as_nobody_prefix() -> list[str]:
    """Run a command as `nobody`: needs root and setpriv."""
    if os.getuid() != 0:
        pytest.skip("switching to another user needs root")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    nobody()
    return ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups"]


def nobody_ddprun(prefix: list[str], env: dict) -> tuple[list[str], dict]:
    """`ddprun` as `nobody`, with an interpreter nobody can start again (ddprun and torch start
    sys.executable): this one, or the system's of the same version when this one lives in a
    folder nobody cannot enter (a venv over ~root/.pyenv), with this venv's packages on the path."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    paths = os.pathsep.join([sysconfig.get_paths()["purelib"], str(Path(runfolders.__file__).parents[1])])
    probe = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import torch, ddprun'], check=True)"
    for python in dict.fromkeys([sys.executable, f"/usr/bin/{version}", shutil.which(version) or ""]):
        if not python:
            continue
        candidate = dict(env, PYTHONPATH=paths)
        if subprocess.run(prefix + [python, "-c", probe], env=candidate, capture_output=True).returncode == 0:
            return prefix + [python, "-m", "ddprun"], candidate
    pytest.skip(f"no {version} interpreter that the user nobody can run with this environment's packages")


def job_env(cpu_env: dict, tmp: Path) -> dict:
    env = dict(cpu_env, TMPDIR=str(tmp))
    env.pop("XDG_RUNTIME_DIR", None)
    return env


# --- the per-user root ----------------------------------------------------------------------


def test_user_root_is_the_private_runtime_dir_else_a_per_uid_folder_in_tmp(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    runtime.chmod(0o700)
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    assert runfolders.user_root(env, uid=UID, tempdir="/tmp") == str(runtime / "ddprun")
    assert runfolders.user_root({}, uid=UID, tempdir="/scratch") == f"/scratch/ddprun-{UID}"
    runtime.chmod(0o755)  # not private: not a place for logs
    assert runfolders.user_root(env, uid=UID, tempdir="/tmp") == f"/tmp/ddprun-{UID}"
    assert runfolders.user_root(env, uid=UID + 1, tempdir="/tmp") == f"/tmp/ddprun-{UID + 1}"
    assert runfolders.user_root({"XDG_RUNTIME_DIR": "relative"}, uid=UID, tempdir="/tmp") == f"/tmp/ddprun-{UID}"
    assert not (runtime / "ddprun").exists()  # a path only: nothing is created


def test_the_root_is_created_0700_whatever_the_umask(tmp_path):
    root = tmp_path / f"ddprun-{UID}"
    old = os.umask(0o277)  # would leave r-x------ without the explicit chmod
    try:
        fd = runfolders.open_private_root(str(root), uid=UID)
    finally:
        os.umask(old)
    os.close(fd)
    assert mode(root) == 0o700


def test_a_symlinked_root_is_refused_and_nothing_goes_through_it(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    root = tmp_path / f"ddprun-{UID}"
    root.symlink_to(target)
    with pytest.raises(UsageError) as caught:
        runfolders.make_job_folder(str(root / "ddprun-0123456789ab"), private_root=True, keep=100)
    assert caught.value.exit_code == 2
    assert str(root) in caught.value.message and "symbolic link" in caught.value.message
    assert "remove it" in caught.value.message
    assert list(target.iterdir()) == []


def test_a_root_of_another_user_is_refused(tmp_path):
    root = tmp_path / f"ddprun-{UID}"
    root.mkdir(mode=0o700)
    if UID != 0:
        pytest.skip("giving a folder to another user needs root")
    os.chown(root, nobody().pw_uid, nobody().pw_gid)
    with pytest.raises(UsageError) as caught:
        runfolders.make_job_folder(str(root / "ddprun-0123456789ab"), private_root=True, keep=100)
    assert f"belongs to another user (uid {nobody().pw_uid})" in caught.value.message
    assert list(root.iterdir()) == []


@pytest.mark.parametrize("bits", [0o777, 0o755, 0o1777, 0o720])
def test_a_root_open_to_others_is_refused(tmp_path, bits):
    root = tmp_path / f"ddprun-{UID}"
    root.mkdir()
    root.chmod(bits)
    with pytest.raises(UsageError) as caught:
        runfolders.make_job_folder(str(root / "ddprun-0123456789ab"), private_root=True, keep=100)
    assert f"{root} is open to other users (mode {stat.S_IMODE(bits):04o})" in caught.value.message
    assert "chmod 700" in caught.value.message
    assert list(root.iterdir()) == []


def test_a_root_that_is_a_file_is_refused(tmp_path):
    root = tmp_path / f"ddprun-{UID}"
    root.write_text("x")
    with pytest.raises(UsageError, match="is not a directory"):
        runfolders.make_job_folder(str(root / "ddprun-0123456789ab"), private_root=True, keep=100)


def test_a_job_folder_is_new_private_and_marked(tmp_path):
    root = tmp_path / "logs"
    runfolders.make_job_folder(str(root / "ddprun-0123456789ab"), private_root=False, keep=100)
    job = root / "ddprun-0123456789ab"
    assert mode(job) == 0o700 and mode(job / runfolders.MARKER) == 0o600
    assert json.loads((job / runfolders.MARKER).read_text())["pid"] == os.getpid()
    with pytest.raises(UsageError, match="cannot create the job's log folder"):  # never reused
        runfolders.make_job_folder(str(job), private_root=False, keep=100)


def test_private_files_keep_0600_when_reopened_for_writing(tmp_path):
    path = tmp_path / "rank_0.stdout.log"
    runfolders.make_private_file(str(path))
    with open(path, "w") as f:  # what torch does with a rank's stdout file
        f.write("hello")
    assert mode(path) == 0o600
    with pytest.raises(FileExistsError):
        runfolders.make_private_file(str(path))


# --- retention ------------------------------------------------------------------------------


def fake_job(root: Path, name: str, *, age: int, launcher: dict | None = None, marker: bool = True) -> Path:
    """A job folder as an earlier ddprun (now gone) left it, `age` seconds old."""
    job = root / name
    job.mkdir(mode=0o700, parents=True)
    (job / "attempt_0").mkdir()
    (job / "attempt_0" / "rank_0.stdout.log").write_text("old")
    if marker:
        (job / runfolders.MARKER).write_text(json.dumps(launcher or {}))
        stamp = 1_700_000_000 - age
        os.utime(job / runfolders.MARKER, (stamp, stamp))
    return job


def prune(root: Path, *, keep: int, current: str = "ddprun-ffffffffffff") -> list[str]:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return runfolders.prune(fd, keep=keep, uid=UID, current=current)
    finally:
        os.close(fd)


def test_retention_keeps_the_newest_and_prunes_only_ddprun_job_folders(tmp_path):
    root = tmp_path / "logs"
    jobs = [fake_job(root, f"ddprun-{i:012x}", age=100 - i) for i in range(5)]  # job 4 is the newest
    unmarked = fake_job(root, "ddprun-aaaaaaaaaaaa", age=1000, marker=False)  # a name alone is not enough
    other_name = fake_job(root, "myrun-000000000000", age=1000)  # a marker alone is not enough
    (root / "attempt_0").mkdir()
    (root / "attempt_0" / "results.csv").write_text("the user's")
    elsewhere = fake_job(tmp_path, "ddprun-bbbbbbbbbbbb", age=1000)
    (root / "ddprun-cccccccccccc").symlink_to(elsewhere)  # never followed
    removed = prune(root, keep=3)  # the current job plus the two newest others
    assert sorted(removed) == sorted(j.name for j in jobs[:3])
    assert [j.exists() for j in jobs] == [False, False, False, True, True]
    assert unmarked.exists() and other_name.exists() and elsewhere.exists()
    assert (root / "attempt_0" / "results.csv").read_text() == "the user's"
    assert (root / "ddprun-cccccccccccc").is_symlink()


def test_retention_spares_a_job_whose_launcher_still_runs(tmp_path):
    root = tmp_path / "logs"
    runfolders.make_job_folder(str(root / "ddprun-000000000001"), private_root=False, keep=0)  # this process's
    old = fake_job(root, "ddprun-000000000002", age=10, launcher={"pid": 1, "host": "elsewhere", "started": 0})
    os.utime(root / "ddprun-000000000001" / runfolders.MARKER, (1, 1))  # the oldest of all
    assert prune(root, keep=1) == [old.name]
    assert (root / "ddprun-000000000001").exists()


def test_retention_keeps_other_users_job_folders(tmp_path):
    if UID != 0:
        pytest.skip("giving a folder to another user needs root")
    root = tmp_path / "logs"
    theirs = fake_job(root, "ddprun-000000000001", age=10)
    for path in (theirs, theirs / runfolders.MARKER):
        os.chown(path, nobody().pw_uid, nobody().pw_gid)
    assert prune(root, keep=1) == []
    assert theirs.exists()


def test_keep_0_keeps_all_and_a_negative_keep_is_a_usage_error(tmp_path, cpu_env):
    root = tmp_path / "logs"
    fake_job(root, "ddprun-000000000001", age=10)
    runfolders.make_job_folder(str(root / "ddprun-000000000002"), private_root=False, keep=0)
    assert len(list(root.iterdir())) == 2
    result = run_ddprun(["run", "--keep-logs", "-1", "--dry-run", SCRIPT], env=cpu_env, timeout=30)
    assert result.returncode == 2 and "--keep-logs -1: must be 0 (keep all) or more" in result.stderr


# --- the CLI: preflight and dry-run ---------------------------------------------------------


def test_dry_run_creates_nothing_and_names_the_per_user_folder(cpu_env, tmp_path):
    env = dict(job_env(cpu_env, tmp_path), DDPRUN_KEEP_LOGS="7")
    result = run_ddprun(["run", "--dry-run", "--json", SCRIPT], env=env, timeout=30)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert Path(plan["log_dir"]).parent == tmp_path / f"ddprun-{UID}"
    assert runfolders.JOB_NAME.match(Path(plan["log_dir"]).name)
    assert plan["private_log_root"] is True and plan["keep_logs"] == 7
    assert list(tmp_path.iterdir()) == []


def test_a_log_dir_under_a_file_exits_2_before_anything_starts(cpu_env, tmp_path):
    (tmp_path / "file").write_text("x")
    result = run_ddprun(["run", "--log-dir", str(tmp_path / "file" / "logs"), SCRIPT], env=cpu_env, timeout=30)
    assert result.returncode == 2, result.stderr
    assert f"{tmp_path / 'file'} is a file, not a folder" in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 2, result.stderr


def test_a_log_dir_the_user_cannot_write_exits_2(cpu_env, tmp_path):
    """As `nobody`, since root writes anywhere: a read-only parent is refused by preflight."""
    prefix = as_nobody_prefix()
    shared = Path(tempfile.mkdtemp(prefix="ddprun-test-ro-"))
    try:
        shared.chmod(0o755)  # root's, readable by nobody, not writable
        command, env = nobody_ddprun(prefix, dict(cpu_env, HOME=str(shared)))
        result = subprocess.run(
            command + ["run", "--log-dir", str(shared / "logs"), SCRIPT],
            env=env, cwd=shared, capture_output=True, text=True, timeout=60,
        )
        assert result.returncode == 2, result.stderr
        assert f"{shared} is not writable by you" in result.stderr
        assert list(shared.iterdir()) == []
    finally:
        shutil.rmtree(shared)


# --- real launches --------------------------------------------------------------------------


def test_a_planted_log_root_is_refused_and_the_victims_file_is_untouched(cpu_env, tmp_path):
    """Another user made `<tmp>/ddprun-<uid>` first, 0777, with a job's pid file pointing at a
    file of ours: the launch exits 2 and writes nothing."""
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    root = tmp_path / f"ddprun-{UID}"
    planted = root / "ddprun-000000000000" / "attempt_0"
    planted.mkdir(parents=True)
    (planted / "rank_0.pid").symlink_to(victim)
    root.chmod(0o777)
    result = run_ddprun(["run", SCRIPT], env=job_env(cpu_env, tmp_path), timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"{root} is open to other users (mode 0777)" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 2
    assert [p.name for p in root.iterdir()] == ["ddprun-000000000000"] and victim.read_text() == "keep me"
    assert not (tmp_path / "out").exists()  # no worker ran

    shutil.rmtree(root)
    root.symlink_to(tmp_path / "theirs")  # a link to a folder they control
    (tmp_path / "theirs").mkdir()
    result = run_ddprun(["run", SCRIPT], env=job_env(cpu_env, tmp_path), timeout=60)
    assert result.returncode == 2 and "is a symbolic link" in result.stderr, result.stderr
    assert list((tmp_path / "theirs").iterdir()) == []


def test_a_second_user_launches_beside_root_and_cannot_read_roots_logs(cpu_env):
    """root runs a job, then `nobody` runs one, both with one shared 1777 temp dir."""
    prefix = as_nobody_prefix()
    shared = Path(tempfile.mkdtemp(prefix="ddprun-test-shared-"))
    try:
        shared.chmod(0o1777)
        env = dict(job_env(cpu_env, shared), HOME=str(shared))
        first = run_ddprun(["run", "--cpu", SCRIPT], env=dict(env, OUT_DIR=str(shared / "out-root")), timeout=120)
        assert first.returncode == 0, first.stderr
        root_logs = shared / f"ddprun-{UID}"
        stdout_log = next(root_logs.glob("ddprun-*/attempt_0/rank_0.stdout.log"))
        assert "sum 3.0" in stdout_log.read_text()
        assert mode(root_logs) == mode(stdout_log.parent.parent) == mode(stdout_log.parent) == 0o700
        assert mode(stdout_log) == 0o600
        peek = subprocess.run(prefix + ["cat", str(stdout_log)], capture_output=True, text=True)
        assert peek.returncode != 0 and "Permission denied" in peek.stderr

        out = shared / "out-nobody"
        command, nobody_env = nobody_ddprun(prefix, dict(env, OUT_DIR=str(out)))
        second = subprocess.run(
            command + ["run", "--cpu", SCRIPT], env=nobody_env, cwd=shared, capture_output=True, text=True, timeout=120,
        )
        assert second.returncode == 0, second.stderr
        assert "Traceback" not in second.stderr
        assert sorted(p.name for p in out.glob("rank*.txt")) == ["rank0.txt", "rank1.txt"]
        theirs = shared / f"ddprun-{nobody().pw_uid}"
        assert os.lstat(theirs).st_uid == nobody().pw_uid and mode(theirs) == 0o700
    finally:
        shutil.rmtree(shared)


def test_a_log_dir_keeps_what_the_user_put_there(cpu_env, tmp_path):
    logs = tmp_path / "mydata"
    (logs / "attempt_0").mkdir(parents=True)
    (logs / "attempt_0" / "results.csv").write_text("epoch,acc\n1,0.9\n")
    result = run_ddprun(["run", "--cpu", "--log-dir", str(logs), SCRIPT], env=cpu_env)
    assert result.returncode == 0, result.stderr
    assert (logs / "attempt_0" / "results.csv").read_text() == "epoch,acc\n1,0.9\n"
    [job] = logs.glob("ddprun-*")
    assert "sum 3.0" in (job / "attempt_0" / "rank_1.stdout.log").read_text()
    assert str(job) in result.stderr  # the plan panel names the job's own folder
    assert mode(job) == 0o700 and mode(job / "attempt_0" / "rank_1.stderr.log") == 0o600
