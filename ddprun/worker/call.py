"""What every rank runs for `ddprun.launch(fn, *args)`: fn(*args), its return value kept for the caller.

Started as `python -m ddprun.worker.bootstrap -m ddprun.worker.call`, like any module, so the
bootstrap has armed the parent-death signal and records an uncaught exception of fn exactly
as it does for a script. The call itself is in the file named by DDPRUN_CALL_FILE, in the job's
private folder (written 0600 by ddprun.api): a pickle of the caller's sys.path and of
(fn, args), the latter made by cloudpickle, so a function defined in a notebook cell or in
__main__ arrives whole. Each rank writes what fn returned, pickled by cloudpickle, to
`result_rank<RANK>.pkl` beside it (0600, complete or absent); the caller reads them in rank order.
"""

from __future__ import annotations

import os
import pickle
import sys

from ddprun.envnames import CALL_FILE_ENV

RESULT_NAME = "result_rank{rank}.pkl"  # the caller's side (ddprun.api) reads the same names


def extend_path(entries: list[str]) -> None:
    """Make what the caller could import importable here: a function from the caller's own
    modules (a test file, a package on a path it added) is pickled by reference."""
    for entry in entries:
        if entry not in sys.path:
            sys.path.append(entry)


def write_result(path: str, data: bytes) -> None:
    """Written whole under a temporary name, then renamed: a rank stopped mid-write leaves nothing."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


def main() -> None:
    path = os.environ.get(CALL_FILE_ENV)
    if not path:
        print(f"ddprun.worker.call: {CALL_FILE_ENV} is not set; this module runs under ddprun.launch()", file=sys.stderr)
        raise SystemExit(2)
    with open(path, "rb") as source:
        payload = pickle.load(source)
    extend_path(payload["sys_path"])
    fn, args = pickle.loads(payload["call"])  # cloudpickle's output loads with pickle (cloudpickle importable)
    result = fn(*args)
    import cloudpickle  # only now: a function that raised needs none of it

    rank = os.environ["RANK"]
    write_result(os.path.join(os.path.dirname(path), RESULT_NAME.format(rank=rank)), cloudpickle.dumps(result))


if __name__ == "__main__":
    main()
