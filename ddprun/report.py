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
_FOLDED = re.compile(r"\.\.\. \S+ traceback \(\d+ lines\), summarized above")
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
    if not _has_record(data):
        data = _read_json(getattr(failure, "error_file", None))
    return data if _has_record(data) else None


def _has_record(data: Any) -> bool:
    # ProcessFailure stands in {"message": "<NONE>"} when there was no error file.
    return isinstance(data, dict) and data.get("message") not in (None, _NO_RECORD)


def _read_json(path: str | None) -> Any:
    if not path or not os.path.isfile(path):
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):  # e.g. a writer killed mid-write
        return None


def _parse_record(
    record: dict | None,
) -> tuple[str | None, str | None, str | None, float | None]:
    """(exception type, message, traceback text, timestamp) from an error file's JSON."""
    if record is None:
        return None, None, None, None
    message = record["message"]
    if not isinstance(message, dict):  # torch's flat format: {"message": str, "timestamp": int}
        return None, str(message), None, _seconds(record.get("timestamp"))
    info = message.get("extraInfo")
    info = info if isinstance(info, dict) else {}
    exc_type, exc_message = split_exception(str(message.get("message", "")))
    stamp = _seconds(info.get("timestamp"))
    if info.get("timestamp_ms") is not None:  # ddprun's bootstrap: millisecond precision
        ms = _seconds(info["timestamp_ms"])
        stamp = ms / 1000 if ms is not None else stamp
    return exc_type, exc_message, info.get("py_callstack") or None, stamp


def split_exception(text: str) -> tuple[str | None, str]:
    """"ValueError: bad" -> ("ValueError", "bad"), as torch's record writes it."""
    name, sep, message = text.partition(": ")
    if sep and name and not any(ch.isspace() for ch in name):
        return name, message
    if text and text.isidentifier():  # "ValueError" alone
        return text, ""
    return None, text


def _seconds(value: Any) -> float | None:
    try:
        return float(int(value))
    except (TypeError, ValueError):
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
    return line.startswith("    ") and bool(set(body) - set("^~ "))


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
    lines = data.decode("utf-8", errors="replace").split("\n")  # not splitlines: it splits \r
    if size > _TAIL_BYTES:
        lines = lines[1:]  # the first line is cut
    # Progress bars rewrite a line with \r: keep what was left on screen.
    return [_RANK_PREFIX.sub("", _on_screen(line)).rstrip() for line in lines]


def _on_screen(line: str) -> str:
    return line.rstrip("\r").rsplit("\r", 1)[-1]


def stderr_tail(
    lines: Sequence[str], *, exc_type: str | None, exc_message: str | None
) -> tuple[str, ...]:
    """The last TAIL_LINES lines, without what the panel already shows.

    The recorded exception's traceback becomes one marker line (the panel has its type,
    message and user frame; the log file has all of it), and faulthandler's frames of
    runpy and ddprun's bootstrap are dropped.
    """
    kept = [line for line in lines if not _is_launch_frame(line) and not _is_noise(line)]
    if exc_type:
        kept = _fold_traceback(kept, exc_type=exc_type, exc_message=exc_message or "")
    while kept and not kept[-1].strip():
        kept.pop()
    if len(kept) == 1 and _FOLDED.fullmatch(kept[0]):
        return ()  # nothing but the folded traceback
    return tuple(kept[-TAIL_LINES:])


def _is_noise(line: str) -> bool:
    return line.startswith("Extension modules: ")  # faulthandler's list of loaded modules


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


# Exit codes ddprun keeps for itself: 2 is "bad input, nothing started"; 130 and 143 come after
# SIGINT / SIGTERM (outside 1..125 anyway). A worker's own code never reads as one of them.
RESERVED_EXIT_CODES = (2,)


def exit_code_for(failure: RankFailure, *, bundled_worker: bool = False) -> int:
    """ddprun's exit code: the worker's own when it is 1..125 and not reserved (2 -> 1), else 1.

    ddprun's own trainer exits 2 when it refuses bad input that only a worker can see (a corrupt
    checkpoint): that is ddprun's refusal, so it stays 2."""
    code = failure.exitcode
    reserved = () if bundled_worker else RESERVED_EXIT_CODES
    return code if 1 <= code <= 125 and code not in reserved else 1


# ---------------------------------------------------------------- the panel

_SIGNAL_WHAT = {
    "SIGKILL": "was killed by SIGKILL",
    "SIGSEGV": "crashed with SIGSEGV (segmentation fault)",
    "SIGBUS": "crashed with SIGBUS (bus error)",
    "SIGABRT": "aborted (SIGABRT)",
    "SIGTERM": "was terminated by SIGTERM",
}
_SIGNAL_HINTS = {
    "SIGKILL": "SIGKILL usually comes from the kernel's out-of-memory killer: check "
    "`dmesg -T | grep -i -e oom -e killed` (or the container's memory limit), then lower "
    "the batch size or the DataLoader's num_workers.",
    "SIGSEGV": "In a container this is often a /dev/shm that is too small for DataLoader "
    "workers or NCCL (`df -h /dev/shm`): start it with `--shm-size=8g` or `--ipc=host`. "
    "Otherwise a native extension crashed; the stack above shows where.",
    "SIGABRT": "A native library aborted (a C++ exception or a failed check, e.g. in CUDA "
    "or NCCL); the lines above usually say why.",
    "SIGTERM": "Something outside the job sent SIGTERM: a scheduler's preemption or time "
    "limit, or a `kill`.",
}
_SIGNAL_HINTS["SIGBUS"] = _SIGNAL_HINTS["SIGSEGV"]
_MESSAGE_LINES = 6


def render_failure(
    failures: Sequence[RankFailure], *, log_location: str | None, attempt: int | None = None,
    notes: Sequence[Text] = (),
) -> Panel:
    """One panel: the root-cause rank, its error and where, its last stderr lines, hints.

    `attempt` is torch's restart count (0 for the first run); shown when it is above 0.
    `notes` follow the other ranks' line: e.g. a collective timeout's likely culprit (ddprun.stall).
    """
    cause = root_cause(failures)
    others = [f for f in failures if f is not cause]
    parts: list[Text] = [_headline(cause), *_where(cause)]
    if others:
        parts.append(_others(others, cause=cause))
    parts.extend(notes)
    if cause.stderr_tail:
        parts.append(Text(f"\nLast lines on rank {cause.rank}'s stderr:", style="bold"))
        parts.extend(
            Text(f"  {line}", style="dim", no_wrap=True, overflow="ellipsis")
            for line in cause.stderr_tail
        )
    parts.append(Text(""))
    parts.append(Text.assemble(("exit code ", "bold"), _exit_text(cause)))
    parts.extend(Text.assemble(("hint: ", "yellow bold"), h) for h in hints_for(cause))
    parts.append(_logs_line(log_location))
    title = "job failed" + (f" (restart {attempt})" if attempt else "")
    return Panel(Group(*parts), title=f"ddprun: {title}", title_align="left", border_style="red")


def summarize(failure: RankFailure) -> str:
    """One line for messages like "restart 1/2: rank 1 was killed by SIGKILL"."""
    first = _headline(failure).plain.splitlines()[0]
    return first[:1].lower() + first[1:]


def _headline(cause: RankFailure) -> Text:
    who = (f"Rank {cause.rank}", "bold red")
    if cause.recorded:
        message = cause.exc_message or ""
        lines = message.splitlines() or [""]
        if len(lines) > _MESSAGE_LINES:
            lines = [*lines[:_MESSAGE_LINES], "..."]
        shown = "\n".join(lines)
        exc = ": ".join(part for part in (cause.exc_type, shown) if part)
        return Text.assemble(who, " failed: ", (exc, "bold"))
    if cause.signal:
        what = _SIGNAL_WHAT.get(cause.signal, f"was killed by {cause.signal}")
        return Text.assemble(who, f" {what}")
    return Text.assemble(who, f" exited with code {cause.exitcode}")


def _where(cause: RankFailure) -> list[Text]:
    if not cause.user_frame:
        return []
    lines = [Text.assemble("  at ", (cause.user_frame, "cyan"))]
    if cause.user_line:
        lines.append(Text(f"     {cause.user_line}", no_wrap=True, overflow="ellipsis"))
    return lines


def _others(others: Sequence[RankFailure], *, cause: RankFailure) -> Text:
    stopped = [f.rank for f in others if f.stopped]
    failed = [f for f in others if not f.stopped]
    pieces = []
    if failed:
        shown = ", ".join(f"rank {f.rank} ({_short_reason(f)})" for f in failed[:3])
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        pieces.append(f"also failed: {shown}{more}")
    if stopped:
        noun = "rank" if len(stopped) == 1 else "ranks"
        pieces.append(f"{noun} {rank_ranges(stopped)} stopped after rank {cause.rank} failed")
    sentence = "; ".join(pieces)
    return Text(sentence[:1].upper() + sentence[1:] + ".", style="dim")


def _short_reason(failure: RankFailure) -> str:
    if failure.recorded:
        return failure.exc_type or "error"
    return failure.signal or f"exit {failure.exitcode}"


def rank_ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for rank in sorted(set(ranks)):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _exit_text(cause: RankFailure) -> str:
    if cause.signal:
        return f"{cause.exitcode} (killed by {cause.signal})"
    return str(cause.exitcode)


def hints_for(cause: RankFailure) -> list[str]:
    """What to check next, from how the root-cause rank ended."""
    if cause.recorded:  # its own exception explains it, whatever signal ended it later
        return _exception_hints(cause)
    if cause.signal:
        return [_SIGNAL_HINTS[cause.signal]] if cause.signal in _SIGNAL_HINTS else []
    code = cause.exitcode
    name = signal_name(128 - code) if code > 128 else None  # a shell reports 128 + signal
    if name in _SIGNAL_HINTS:
        return [f"{code} = 128 + {code - 128}: a shell or wrapper reported {name}. "
                + _SIGNAL_HINTS[name]]
    hints = [f"No Python exception was raised: the script called sys.exit({code}) or "
             f"os._exit({code}), or a native library exited."]
    if code == 2 and any(line.lstrip().startswith("usage:") for line in cause.stderr_tail):
        hints.append("argparse exits with 2 when it rejects the arguments: see the usage "
                      "message above.")
    return hints


def _exception_hints(cause: RankFailure) -> list[str]:
    text = f"{cause.exc_type}: {cause.exc_message}"
    if "OutOfMemoryError" in text or "out of memory" in text:
        return ["The GPU ran out of memory: lower the batch size per GPU, or use mixed "
                "precision or gradient accumulation."]
    if cause.peer_lost:
        return ["This rank only lost its connection to another rank, which probably failed "
                "first: if the job spans several nodes, check the other nodes' logs."]
    return []


def _logs_line(log_location: str | None) -> Text:
    if log_location:
        return Text.assemble(("logs: ", "bold"), "every rank's full output is in ",
                             (log_location, "cyan"))
    return Text("Per-rank logs were not kept; rerun with --log-dir DIR to keep them.",
                style="dim")
