"""Turn torch elastic's failures into one short panel that names the real error.

What torch 2.14.1 puts in `ChildFailedError.failures` (measured with 2 ranks on gloo):
- Every rank that did not exit 0 appears, survivors included: the agent polls, SIGTERMs the
  rest and polls again, so survivors come with exitcode -15. Insertion order is detection
  order (the ranks that failed first come first).
- Ranks without an error file get `timestamp = int(time.time())` at detection: the root cause
  and the survivors usually share the same second, so torch's "first failure" is a coin toss.
- A survivor blocked in a gloo collective often raises "Connection closed by peer" before its
  SIGTERM lands, so it has a recorded exception *and* exitcode -15, while the real culprit
  (SIGKILL, SIGSEGV, sys.exit(3)) has no record at all. Recorded exceptions therefore cannot
  simply win: errors that only say "a peer went away" rank below any rank that died on its own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.text import Text

TAIL_LINES = 20
_TAIL_BYTES = 256 * 1024
_SIGTERM = "SIGTERM"
_NO_RECORD = "<NONE>"
_PACKAGE_DIR = str(Path(__file__).resolve().parent)
_LIBRARY_DIRS = tuple(
    {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
)
_TB_HEADER = "Traceback (most recent call last):"
_TB_CHAIN = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)
# `  File "x.py", line 3, in f` (traceback) and `  File "x.py", line 3 in f` (faulthandler).
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?:,? in (?P<func>.+))?$')
_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")  # torch's excepthook prefix
# Messages of a rank that failed only because a peer was gone (gloo, NCCL, the TCP store).
_PEER_LOST = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "ncclremoteerror",
    "nccl communicator was aborted",
)


@dataclass(frozen=True)
class RankFailure:
    """One failed (or stopped) rank, with what its error file and stderr log say."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    signal: str | None  # "SIGKILL" when exitcode < 0
    exc_type: str | None
    exc_message: str | None
    user_frame: str | None  # "train.py:42 in forward": innermost frame outside ddprun/torch/stdlib
    traceback: str | None
    timestamp: float  # seconds: from the error file when recorded, else detection time
    stderr_tail: tuple[str, ...]  # last lines on stderr, the recorded traceback folded away
    user_line: str | None = None  # the source line at user_frame, when the traceback shows it

    @property
    def recorded(self) -> bool:
        return self.exc_type is not None or self.exc_message is not None

    @property
    def peer_lost(self) -> bool:
        """Its exception only says that another rank went away."""
        text = f"{self.exc_type}: {self.exc_message}".lower()
        return self.recorded and any(marker in text for marker in _PEER_LOST)

    @property
    def stopped(self) -> bool:
        """Terminated by the launcher after another rank failed (or by an outside SIGTERM)."""
        return self.signal == _SIGTERM


@dataclass(frozen=True)
class _Frame:
    file: str
    line: int
    func: str | None
    code: str | None = None


# ---------------------------------------------------------------- reading torch's failures


def failures_from_torch(
    failures: Mapping[int, Any], *, stderr_logs: Mapping[int, Path], cwd: Path | None = None
) -> list[RankFailure]:
    """RankFailures from `ChildFailedError.failures` ({global rank: ProcessFailure}).

    Keeps the mapping's order, which is torch's detection order. `cwd` only shortens the
    paths shown (default: the current directory).
    """
    base = str(cwd or Path.cwd())
    return [
        _rank_failure(rank, failure, stderr=_read_tail(stderr_logs.get(rank)), cwd=base)
        for rank, failure in failures.items()
    ]


def _rank_failure(rank: int, failure: Any, *, stderr: list[str], cwd: str) -> RankFailure:
    exitcode = int(failure.exitcode)
    record = _error_record(failure)
    exc_type, exc_message, callstack, stamp = _parse_record(record)
    frames = _traceback_frames(callstack) if callstack else _faulthandler_frames(stderr)
    frame = innermost_user_frame(frames)
    return RankFailure(
        rank=rank,
        local_rank=int(failure.local_rank),
        pid=int(failure.pid),
        exitcode=exitcode,
        signal=signal_name(exitcode),
        exc_type=exc_type,
        exc_message=exc_message,
        user_frame=_describe(frame, cwd=cwd) if frame else None,
        traceback=callstack,
        timestamp=stamp if stamp is not None else float(failure.timestamp),
        stderr_tail=stderr_tail(stderr, exc_type=exc_type, exc_message=exc_message),
        user_line=frame.code if frame else None,
    )


def signal_name(exitcode: int) -> str | None:
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _error_record(failure: Any) -> dict | None:
    """The error file's JSON: ProcessFailure has read it already; else read the file."""
    data = getattr(failure, "error_file_data", None)
    if not isinstance(data, dict) or data.get("message") in (None, _NO_RECORD):
        path = getattr(failure, "error_file", None)
        data = None
        if path and os.path.isfile(path):
            try:
                data = json.loads(Path(path).read_text())
            except (OSError, ValueError):
                return None
    if not isinstance(data, dict) or data.get("message") in (None, _NO_RECORD):
        return None
    return data


def _parse_record(
    record: dict | None,
) -> tuple[str | None, str | None, str | None, float | None]:
    """(exception type, message, traceback text, timestamp) from an error file's JSON."""
    if record is None:
        return None, None, None, None
    message = record["message"]
    if isinstance(message, str):  # torch's flat format: {"message": str, "timestamp": int}
        stamp = record.get("timestamp")
        return None, message, None, float(stamp) if stamp is not None else None
    info = message.get("extraInfo") or {}
    exc_type, _, exc_message = str(message.get("message", "")).partition(": ")
    return exc_type or None, exc_message, info.get("py_callstack"), _record_time(info)


def _record_time(info: Mapping[str, Any]) -> float | None:
    try:
        if "timestamp_ms" in info:  # ddprun's bootstrap: millisecond precision
            return int(info["timestamp_ms"]) / 1000
        if "timestamp" in info:  # torch's @record: whole seconds
            return float(int(info["timestamp"]))
    except (TypeError, ValueError):
        pass
    return None


# ---------------------------------------------------------------- frames


def is_user_file(path: str) -> bool:
    """False for ddprun, torch, runpy, the standard library and installed packages."""
    if path.startswith("<"):  # <frozen runpy>, <string>
        return False
    parts = Path(path).parts
    if "site-packages" in parts or "dist-packages" in parts or "torch" in parts:
        return False
    full = os.path.abspath(path)
    return not any(full.startswith(d + os.sep) for d in (_PACKAGE_DIR, *_LIBRARY_DIRS))


def innermost_user_frame(frames: Sequence[_Frame]) -> _Frame | None:
    """The last frame (innermost) in the user's own files; frames run outermost first."""
    return next((f for f in reversed(frames) if is_user_file(f.file)), None)


def _traceback_frames(text: str) -> list[_Frame]:
    """Frames of the last exception in a Python traceback text, outermost first."""
    frames: list[_Frame] = []
    for raw in text.splitlines():
        line = _RANK_PREFIX.sub("", raw)
        match = _FRAME.match(line)
        if line.startswith(_TB_HEADER):
            frames = []
        elif match:
            frames.append(_frame(match))
        elif frames and frames[-1].code is None and _is_code(line):
            last = frames[-1]
            frames[-1] = _Frame(last.file, last.line, last.func, line.strip())
    return frames


def _faulthandler_frames(lines: Sequence[str]) -> list[_Frame]:
    """Frames of the crashing thread in faulthandler's dump (a segfault), outermost first."""
    starts = [i for i, line in enumerate(lines) if line.startswith("Current thread ")]
    if not starts:
        return []
    frames = []
    for line in lines[starts[-1] + 1 :]:
        match = _FRAME.match(line)
        if not match:
            break
        frames.append(_frame(match))
    return frames[::-1]  # faulthandler lists the most recent call first


def _frame(match: re.Match) -> _Frame:
    return _Frame(match["file"], int(match["line"]), match["func"])


def _is_code(line: str) -> bool:
    body = line.strip()
    return line.startswith("    ") and bool(body) and set(body) - set("^~ ")


def _describe(frame: _Frame, *, cwd: str) -> str:
    path = frame.file
    if os.path.isabs(path) and path.startswith(cwd.rstrip(os.sep) + os.sep):
        path = os.path.relpath(path, cwd)
    return f"{path}:{frame.line}" + (f" in {frame.func}" if frame.func else "")


# ---------------------------------------------------------------- stderr


def _read_tail(path: Path | None) -> list[str]:
    """The last lines of a (possibly huge) log file, as a terminal would have shown them."""
    if path is None:
        return []
    try:
        with open(path, "rb") as fp:
            size = fp.seek(0, os.SEEK_END)
            fp.seek(max(0, size - _TAIL_BYTES))
            data = fp.read()
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > _TAIL_BYTES:
        lines = lines[1:]  # the first line is cut
    # Progress bars rewrite a line with \r: keep what was left on screen.
    return [_RANK_PREFIX.sub("", line.rsplit("\r", 1)[-1]).rstrip() for line in lines]


def stderr_tail(
    lines: Sequence[str], *, exc_type: str | None, exc_message: str | None
) -> tuple[str, ...]:
    """The last TAIL_LINES lines, without what the panel already shows.

    The recorded exception's traceback becomes one marker line (the panel has its type,
    message and user frame; the log file has all of it), and faulthandler's frames of
    runpy and ddprun's bootstrap are dropped.
    """
    kept = [line for line in lines if not _is_launch_frame(line)]
    if exc_type:
        kept = _fold_traceback(kept, exc_type=exc_type, exc_message=exc_message or "")
    while kept and not kept[-1].strip():
        kept.pop()
    if len(kept) == 1 and kept[0].startswith("..."):
        return ()  # nothing but the folded traceback
    return tuple(kept[-TAIL_LINES:])


def _is_launch_frame(line: str) -> bool:
    match = _FRAME.match(line)
    return bool(match) and (
        match["file"] == "<frozen runpy>" or match["file"].endswith("ddprun/worker/bootstrap.py")
    )


def _fold_traceback(lines: list[str], *, exc_type: str, exc_message: str) -> list[str]:
    headers = [i for i, line in enumerate(lines) if line == _TB_HEADER]
    if not headers:
        return lines
    start = headers[-1]
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:1] not in ("", " ")), None)
    if end is None or not _names_exception(lines[end], exc_type):
        return lines  # the last traceback on stderr is not the recorded one
    end += max(1, len(exc_message.splitlines()))
    start = _chain_start(lines, start, headers)
    marker = f"... {exc_type} traceback ({end - start} lines), summarized above"
    return [*lines[:start], marker, *lines[end:]]


def _names_exception(line: str, exc_type: str) -> bool:
    # Printed qualified ("torch.OutOfMemoryError: ..."); recorded by its short name.
    return line.split(":", 1)[0].rsplit(".", 1)[-1] == exc_type


def _chain_start(lines: list[str], start: int, headers: list[int]) -> int:
    """Walk back over the tracebacks chained to this one ("During handling of ...")."""
    while start >= 2 and lines[start - 2] in _TB_CHAIN:
        earlier = [h for h in headers if h < start - 2]
        if not earlier:
            break
        start = earlier[-1]
    return start


# ---------------------------------------------------------------- root cause and exit code


def root_cause(failures: Sequence[RankFailure]) -> RankFailure:
    """The first rank to fail by its own error, not one stopped because another failed.

    In order: recorded exceptions by earliest timestamp; ranks that died on their own with no
    record (exit > 0, any signal but SIGTERM) in detection order; recorded "peer went away"
    errors; then anything, in detection order.
    """
    if not failures:
        raise ValueError("root_cause needs at least one failure")
    order = {id(f): i for i, f in enumerate(failures)}

    def key(f: RankFailure) -> tuple[int, float, int]:
        if f.recorded and not f.peer_lost:
            return (0, f.timestamp, order[id(f)])
        if not f.recorded and f.exitcode != 0 and not f.stopped:
            return (1, 0.0, order[id(f)])
        if f.recorded:
            return (2, f.timestamp, order[id(f)])
        return (3, 0.0, order[id(f)])

    return min(failures, key=key)


def exit_code_for(failure: RankFailure) -> int:
    """ddprun's exit code: the worker's own when it is 1..125, else 1."""
    return failure.exitcode if 1 <= failure.exitcode <= 125 else 1
