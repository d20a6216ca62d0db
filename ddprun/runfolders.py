"""Where a job's files go: a private folder per user, a fresh folder per job, and a bound on how many stay.

Every job writes under `<root>/<job id>/`, a folder ddprun has just created (mode 0700) and
marked with a small file. `<root>` is the user's `--log-dir DIR`, or ddprun's per-user root:
`$XDG_RUNTIME_DIR/ddprun` when that runtime dir is the user's own and private, else
`<temp dir>/ddprun-<uid>`. On a shared machine the per-user root is trusted only when it is a
real folder of this user that no one else can read or write; anything else is refused, never
repaired. After a job's folder is made, ddprun's own older job folders there beyond the newest
`keep` are deleted: only folders with a job id's name, this user's, holding the marker, and
whose launcher is not running. Nothing else is ever touched.

Paths are opened relative to an fd checked with fstat (O_NOFOLLOW, O_DIRECTORY), so a folder
swapped for a symlink between a check and its use is refused rather than followed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass
from typing import Mapping

from ddprun.errors import DdprunError, UsageError

DEFAULT_KEEP = 100
_START_SLACK_S = 1.5  # how far a process's start time, as psutil reads it, may move
MARKER = ".ddprun-job"  # written in every job folder ddprun creates; nothing without it is pruned
JOB_NAME = re.compile(r"^ddprun-[0-9a-f]{8,32}$")  # the job ids the CLI makes
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


# --- where ----------------------------------------------------------------------------------


def user_root(env: Mapping[str, str], *, uid: int, tempdir: str) -> str:
    """The per-user root, without creating anything: `$XDG_RUNTIME_DIR/ddprun` when that dir is
    this user's own with mode 0700, else `<tempdir>/ddprun-<uid>`."""
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and _is_private_dir(runtime, uid=uid):
        return os.path.join(runtime, "ddprun")
    return os.path.join(tempdir, f"ddprun-{uid}")


def default_root() -> str:
    return user_root(os.environ, uid=os.getuid(), tempdir=tempfile.gettempdir())


def _is_private_dir(path: str, *, uid: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid and stat.S_IMODE(st.st_mode) == 0o700


# --- the root -------------------------------------------------------------------------------


def root_problem(st: os.stat_result, *, uid: int) -> str | None:
    """What makes a per-user root untrustworthy, from its lstat/fstat; None when it is fine."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != uid:
        return f"belongs to another user (uid {st.st_uid})"
    if stat.S_IMODE(st.st_mode) & 0o077:
        return f"is open to other users (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _refuse_root(path: str, problem: str) -> UsageError:
    return UsageError(
        f"{path} {problem}; ddprun keeps each user's logs in a private folder and will not use it: "
        f"remove it (or chmod 700 it, if it is yours), or pass --log-dir DIR"
    )


def open_private_root(path: str, *, uid: int) -> int:
    """An fd on the per-user root, created 0700 when missing; refuses one that is a symlink,
    another user's, or open to group or others."""
    try:
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        created = False
    except OSError as error:
        raise UsageError(f"cannot create ddprun's log folder {path}: {error.strerror}; pass --log-dir DIR") from None
    try:
        problem = root_problem(os.lstat(path), uid=uid)
    except OSError as error:
        raise UsageError(f"cannot use ddprun's log folder {path}: {error.strerror}; pass --log-dir DIR") from None
    if problem:
        raise _refuse_root(path, problem)
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:  # swapped for a link or a file since the lstat
        raise _refuse_root(path, "changed while ddprun checked it") from None
    if created:
        os.fchmod(fd, 0o700)  # whatever the umask left
    problem = root_problem(os.fstat(fd), uid=uid)
    if problem:
        os.close(fd)
        raise _refuse_root(path, problem)
    return fd


def open_user_root(path: str) -> int:
    """An fd on the user's --log-dir DIR, created (as `mkdir -p` would) when missing."""
    try:
        os.makedirs(path, exist_ok=True)
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as error:
        raise UsageError(f"--log-dir {path}: cannot use it ({error.strerror}); give a folder you can write, e.g. --log-dir ./logs") from None


# --- a job's folder -------------------------------------------------------------------------


@dataclass(frozen=True)
class JobFolder:
    name: str
    mtime_ns: int
    launcher: dict


def make_job_folder(log_dir: str, *, private_root: bool, keep: int) -> None:
    """Create `log_dir` (`<root>/<job id>`) fresh with mode 0700 and its marker, then prune the
    root to the newest `keep` job folders (0: keep all). Raises UsageError before anything starts."""
    root, name = os.path.split(log_dir.rstrip("/"))
    if not JOB_NAME.match(name):
        raise DdprunError(f"{log_dir}: not a job folder name ddprun makes")
    uid = os.getuid()
    root_fd = open_private_root(root, uid=uid) if private_root else open_user_root(root)
    try:
        _create_job(root_fd, name, shown=log_dir)
        if keep > 0:
            prune(root_fd, keep=keep, uid=uid, current=name)
    finally:
        os.close(root_fd)


def _create_job(root_fd: int, name: str, *, shown: str) -> None:
    try:
        os.mkdir(name, 0o700, dir_fd=root_fd)
        job_fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    except OSError as error:
        raise UsageError(f"cannot create the job's log folder {shown}: {error.strerror}; pass --log-dir DIR") from None
    try:
        os.fchmod(job_fd, 0o700)
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": _start_time(os.getpid())})
        marker = os.open(MARKER, _NEW_FILE_FLAGS, 0o600, dir_fd=job_fd)
        with os.fdopen(marker, "w") as f:
            f.write(record + "\n")
    finally:
        os.close(job_fd)


def folder_problem(path: str) -> str | None:
    """Why a folder could not be created (or written) at `path`, or None; creates nothing.

    Looks at `path` itself when it exists, else at its nearest existing ancestor (a path under a
    file reads as missing all the way up to that file)."""
    target = os.path.abspath(path)
    if os.path.exists(target) and not os.path.isdir(target):
        return f"{target} is a file, not a folder"
    existing = target
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable by you"
    return None


def make_private_dir(path: str) -> None:
    """A new folder (never an existing one) with mode 0700, inside a folder ddprun made."""
    os.mkdir(path, 0o700)
    os.chmod(path, 0o700)


def make_private_file(path: str) -> None:
    """A new empty file with mode 0600; whoever opens it later with "w" keeps that mode."""
    fd = os.open(path, _NEW_FILE_FLAGS, 0o600)
    os.fchmod(fd, 0o600)
    os.close(fd)


# --- retention ------------------------------------------------------------------------------


def prune(root_fd: int, *, keep: int, uid: int, current: str) -> list[str]:
    """Delete ddprun's job folders in root beyond the newest `keep` (the current job counts),
    skipping any whose launcher still runs. Best effort: never fails the job. Returns what went."""
    others = sorted(_job_folders(root_fd, uid=uid, skip=current), key=lambda j: j.mtime_ns, reverse=True)
    removed = []
    for job in others[max(0, keep - 1):]:
        if _launcher_running(job.launcher):
            continue
        try:
            shutil.rmtree(job.name, dir_fd=root_fd)  # fd-based: it never follows a symlink
            removed.append(job.name)
        except OSError:
            pass  # another ddprun pruning at the same moment, or a file it cannot remove
    return removed


def _job_folders(root_fd: int, *, uid: int, skip: str) -> list[JobFolder]:
    found = []
    with os.scandir(root_fd) as entries:
        for entry in entries:
            if entry.name != skip and JOB_NAME.match(entry.name):
                job = _read_job(root_fd, entry.name, uid=uid)
                if job is not None:
                    found.append(job)
    return found


def _read_job(root_fd: int, name: str, *, uid: int) -> JobFolder | None:
    """The job folder `name`, if it is a real folder of this user holding ddprun's marker."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    except OSError:
        return None  # a symlink, a file, gone
    try:
        if os.fstat(fd).st_uid != uid:
            return None
        marker = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        with os.fdopen(marker, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                return None
            text = f.read(4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    return JobFolder(name, st.st_mtime_ns, _parse_launcher(text))


def _parse_launcher(text: bytes) -> dict:
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def running_jobs(root: str, *, uid: int) -> list[str]:
    """Names of this user's job folders in root whose launcher still runs (for `ddprun stacks`)."""
    try:
        root_fd = os.open(root, _DIR_FLAGS)
    except OSError:
        return []
    try:
        jobs = _job_folders(root_fd, uid=uid, skip="")
    finally:
        os.close(root_fd)
    return sorted(job.name for job in jobs if _launcher_running(job.launcher))


def job_launcher(folder: os.PathLike | str) -> dict | None:
    """The launcher record in a job folder made by this user, or None when it holds none."""
    root, name = os.path.split(os.path.abspath(folder))
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        job = _read_job(root_fd, name, uid=os.getuid())
    finally:
        os.close(root_fd)
    return job.launcher if job is not None else None


def launcher_running(launcher: dict) -> bool:
    return _launcher_running(launcher)


def _launcher_running(launcher: dict) -> bool:
    """Whether the ddprun that made a job folder still runs on this host (same pid, same start)."""
    pid, started = launcher.get("pid"), launcher.get("started")
    if launcher.get("host") != socket.gethostname() or not isinstance(pid, int) or started is None:
        return False
    now = _start_time(pid)
    # psutil adds /proc/stat's btime, which moves by a second when the clock is adjusted: an
    # exact match would call a running launcher gone (seen in tests). A reused pid starts later.
    return now is not None and isinstance(started, (int, float)) and abs(now - started) < _START_SLACK_S


def _start_time(pid: int) -> float | None:
    import psutil  # only at launch: the CLI's fast paths never get here

    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None

