"""ddprun.report: from torch elastic's recorded failures to the panel a person reads.

The failure objects mimic torch's ProcessFailure (local_rank, pid, exitcode, error_file,
error_file_data, timestamp); the error files and stderr logs are shaped like what a real
2-rank gloo job produced under torch 2.14.1.
"""

from __future__ import annotations

import json
import sysconfig
from io import StringIO
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from ddprun import report
from ddprun.report import (
    RankFailure,
    exit_code_for,
    failures_from_torch,
    is_user_file,
    rank_ranges,
    render_failure,
    root_cause,
)

SITE = sysconfig.get_paths()["purelib"]
STDLIB = sysconfig.get_paths()["stdlib"]
BOOTSTRAP = str(Path(report.__file__).parent / "worker" / "bootstrap.py")
T0 = 1_796_216_000  # a second in which everything below happens
GLOO_PEER_LOST = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed "
    "by peer [127.0.0.1]:2440. This is typically caused by a remote worker crashing."
)


# ---------------------------------------------------------------- builders


def traceback_text(workdir: Path, exc_line: str, *, prefix: str = "") -> str:
    """A Python traceback through user code into torch, as the bootstrap leaves it."""
    lines = [
        "Traceback (most recent call last):",
        f'  File "{workdir}/train.py", line 60, in <module>',
        "    main()",
        f'  File "{workdir}/train.py", line 50, in main',
        "    loss = step(model, batch)",
        "           ^^^^^^^^^^^^^^^^^^",
        f'  File "{workdir}/model.py", line 42, in forward',
        "    x = self.fc(x.view(3, 4))",
        f'  File "{SITE}/torch/nn/modules/module.py", line 1775, in _call_impl',
        "    return forward_call(*args, **kwargs)",
        exc_line,
    ]
    return "".join(f"{prefix}{line}\n" for line in lines)


def error_file(path: Path, exc: str, *, callstack: str, ms: int | None) -> Path:
    """An error file as ddprun's bootstrap writes it (ms=None: as torch's @record does)."""
    info = {"py_callstack": callstack, "timestamp": str((ms or T0 * 1000) // 1000)}
    if ms is not None:
        info["timestamp_ms"] = str(ms)
    path.write_text(json.dumps({"message": {"message": exc, "extraInfo": info}}))
    return path


def process_failure(
    local_rank: int, exitcode: int, *, error: Path | None = None, detected: int = T0
) -> SimpleNamespace:
    """What torch's ProcessFailure holds once it has read (or not found) the error file."""
    if error is None:
        return SimpleNamespace(
            local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode,
            error_file="<N/A>", error_file_data={"message": "<NONE>"}, timestamp=detected,
        )
    data = json.loads(error.read_text())
    return SimpleNamespace(
        local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode, error_file=str(error),
        error_file_data=data, timestamp=int(data["message"]["extraInfo"]["timestamp"]),
    )


def log(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def render(failures, *, log_location="/tmp/ddprun/logs/attempt_0", attempt=None) -> str:
    console = Console(file=StringIO(), width=100, color_system=None)
    console.print(render_failure(failures, log_location=log_location, attempt=attempt))
    return console.file.getvalue()


def failure(rank: int, exitcode: int, **fields) -> RankFailure:
    values = dict(
        rank=rank, local_rank=rank, pid=100 + rank, exitcode=exitcode,
        signal=report.signal_name(exitcode), exc_type=None, exc_message=None, user_frame=None,
        traceback=None, timestamp=float(T0), stderr_tail=(),
    )
    values.update(fields)
    return RankFailure(**values)


# ---------------------------------------------------------------- the scenarios


def test_exception_on_rank_1_only_names_rank_1_not_the_rank_stopped_afterwards(tmp_path):
    tb = traceback_text(tmp_path, "ValueError: shape (3, 4) is invalid")
    err = error_file(tmp_path / "e1.json", "ValueError: shape (3, 4) is invalid",
                     callstack=tb, ms=T0 * 1000 + 757)
    logs = {
        0: log(tmp_path / "r0.log", "epoch 0 step 1\n"),
        1: log(tmp_path / "r1.log", "loading data\nepoch 0 step 1\n" + tb),
    }
    # torch lists the rank it saw first first; the survivor got SIGTERM in the same second.
    torch_failures = {1: process_failure(1, 1, error=err), 0: process_failure(0, -15)}

    failures = failures_from_torch(torch_failures, stderr_logs=logs, cwd=tmp_path)
    cause = root_cause(failures)

    assert cause.rank == 1
    assert (cause.exc_type, cause.exc_message) == ("ValueError", "shape (3, 4) is invalid")
    assert cause.user_frame == "model.py:42 in forward"
    assert cause.user_line == "x = self.fc(x.view(3, 4))"
    assert cause.timestamp == pytest.approx(T0 + 0.757)
    assert exit_code_for(cause) == 1
    assert cause.stderr_tail == (
        "loading data",
        "epoch 0 step 1",
        "... ValueError traceback (11 lines), summarized above",
    )
    text = render(failures)
    assert "Rank 1 failed: ValueError: shape (3, 4) is invalid" in text
    assert "at model.py:42 in forward" in text
    assert "x = self.fc(x.view(3, 4))" in text
    assert "Rank 0 stopped after rank 1 failed." in text
    assert "Last lines on rank 1's stderr:" in text
    assert "exit code 1" in text
    assert "/tmp/ddprun/logs/attempt_0" in text
    assert "module.py" not in text  # torch's frames stay hidden
    assert "ChildFailedError" not in text and "error_file" not in text


def test_exception_on_every_rank_earliest_wins_even_within_one_second(tmp_path):
    torch_failures = {}
    for rank, ms in ((0, 900), (1, 120), (2, 450)):
        exc = f"KeyError: 'rank {rank}'"
        err = error_file(tmp_path / f"e{rank}.json", exc,
                         callstack=traceback_text(tmp_path, exc), ms=T0 * 1000 + ms)
        torch_failures[rank] = process_failure(rank, 1, error=err)

    failures = failures_from_torch(torch_failures, stderr_logs={}, cwd=tmp_path)

    assert {f.timestamp // 1 for f in failures} == {T0}  # torch's whole seconds would tie
    assert root_cause(failures).rank == 1
    text = render(failures)
    assert "Rank 1 failed: KeyError: 'rank 1'" in text
    assert "Also failed: rank 0 (KeyError), rank 2 (KeyError)." in text


def test_sys_exit_3_reports_exit_code_3_and_no_exception(tmp_path):
    logs = {1: log(tmp_path / "r1.log", "config invalid, giving up\n")}
    failures = failures_from_torch(
        {1: process_failure(1, 3), 0: process_failure(0, -15)}, stderr_logs=logs
    )
    cause = root_cause(failures)

    assert (cause.rank, cause.exitcode, cause.exc_type, cause.signal) == (1, 3, None, None)
    assert exit_code_for(cause) == 3
    text = render(failures)
    assert "Rank 1 exited with code 3" in text
    assert "config invalid, giving up" in text
    assert "exit code 3" in text
    assert "sys.exit(3)" in text


def test_os_exit_7_reports_exit_code_7(tmp_path):
    failures = failures_from_torch({0: process_failure(0, 7)}, stderr_logs={})
    cause = root_cause(failures)

    assert exit_code_for(cause) == 7
    text = render(failures)
    assert "Rank 0 exited with code 7" in text
    assert "os._exit(7)" in text
    assert "Rank" in text and "stopped" not in text  # nobody else to mention


def test_sigkill_beats_the_peer_lost_error_the_survivor_recorded(tmp_path):
    """Measured: rank 1 is SIGKILLed (no record); rank 0's all_reduce raises "Connection
    closed by peer", is recorded, and then rank 0 gets the agent's SIGTERM."""
    survivor_tb = traceback_text(tmp_path, f"RuntimeError: {GLOO_PEER_LOST}", prefix="[rank0]: ")
    err0 = error_file(tmp_path / "e0.json", f"RuntimeError: {GLOO_PEER_LOST}",
                      callstack=survivor_tb, ms=T0 * 1000 + 487)
    logs = {
        0: log(tmp_path / "r0.log", survivor_tb),
        1: log(tmp_path / "r1.log", "step 10 loss 2.31\nstep 11 loss 2.29\n"),
    }
    torch_failures = {0: process_failure(0, -15, error=err0), 1: process_failure(1, -9)}

    failures = failures_from_torch(torch_failures, stderr_logs=logs, cwd=tmp_path)
    cause = root_cause(failures)

    assert cause.rank == 1 and cause.signal == "SIGKILL"
    assert exit_code_for(cause) == 1
    assert failures[0].peer_lost and failures[0].stopped
    text = render(failures)
    assert "Rank 1 was killed by SIGKILL" in text
    assert "exit code -9 (killed by SIGKILL)" in text
    assert "out-of-memory killer" in text and "dmesg" in text
    assert "step 11 loss 2.29" in text
    assert "Rank 0 stopped after rank 1 failed." in text


def test_segfault_hints_at_dev_shm_and_finds_the_user_frame_in_faulthandler_output(tmp_path):
    crash = "\n".join([
        "step 3",
        "Fatal Python error: Segmentation fault",
        "",
        "Current thread 0x00007f269ce2eb80 (most recent call first):",
        f'  File "{STDLIB}/ctypes/__init__.py", line 519 in string_at',
        f'  File "{tmp_path}/train.py", line 16 in <module>',
        '  File "<frozen runpy>", line 88 in _run_code',
        '  File "<frozen runpy>", line 291 in run_path',
        f'  File "{BOOTSTRAP}", line 58 in run_user_code',
        f'  File "{BOOTSTRAP}", line 129 in main',
        "",
        "Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)",
        "",
    ])
    logs = {1: log(tmp_path / "r1.log", crash + "\n")}
    failures = failures_from_torch(
        {1: process_failure(1, -11), 0: process_failure(0, -15)}, stderr_logs=logs, cwd=tmp_path
    )
    cause = root_cause(failures)

    assert (cause.rank, cause.signal) == (1, "SIGSEGV")
    assert cause.user_frame == "train.py:16 in <module>"
    assert not any("runpy" in line or "bootstrap" in line for line in cause.stderr_tail)
    assert cause.stderr_tail[-1] == f'  File "{tmp_path}/train.py", line 16 in <module>'
    text = render(failures)
    assert "Rank 1 crashed with SIGSEGV (segmentation fault)" in text
    assert "at train.py:16 in <module>" in text
    assert "/dev/shm" in text and "--shm-size" in text and "--ipc=host" in text
    assert "exit code -11 (killed by SIGSEGV)" in text


def test_sigbus_gets_the_same_shm_hint():
    text = render([failure(0, -7)])
    assert "SIGBUS" in text and "/dev/shm" in text


# ---------------------------------------------------------------- root cause rules


def test_recorded_exception_wins_over_a_plain_nonzero_exit():
    recorded = failure(2, 1, exc_type="ValueError", exc_message="x", timestamp=T0 + 0.9)
    exited = failure(0, 1)
    assert root_cause([exited, recorded]) is recorded


def test_a_stopped_rank_that_recorded_its_own_error_first_is_the_root_cause():
    # Rank 0 raised first but hung at shutdown; rank 1's collateral error exited first.
    rank0 = failure(0, -15, exc_type="ValueError", exc_message="bad", timestamp=T0 + 0.1)
    rank1 = failure(1, 1, exc_type="RuntimeError", exc_message=GLOO_PEER_LOST, timestamp=T0 + 0.2)
    assert root_cause([rank1, rank0]) is rank0
    text = render([rank1, rank0])
    assert "Rank 0 failed: ValueError: bad" in text
    assert "outside the job" not in text  # that SIGTERM came from the launcher


def test_without_records_detection_order_decides_and_sigterm_comes_last():
    stopped = failure(0, -15)
    killed = failure(3, -9)
    exited = failure(1, 2)
    assert root_cause([stopped, killed, exited]) is killed
    assert root_cause([stopped]) is stopped


def test_peer_lost_errors_alone_pick_the_earliest():
    a = failure(0, 1, exc_type="RuntimeError", exc_message=GLOO_PEER_LOST, timestamp=T0 + 0.5)
    b = failure(1, 1, exc_type="RuntimeError", exc_message="Broken pipe", timestamp=T0 + 0.2)
    assert root_cause([a, b]) is b
    assert "lost its connection to another rank" in render([a, b])


def test_root_cause_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        root_cause([])


@pytest.mark.parametrize(
    ("exitcode", "expected"),
    [(1, 1), (3, 3), (7, 7), (125, 125), (126, 1), (137, 1), (255, 1), (-9, 1), (-15, 1), (0, 1)],
)
def test_exit_code_for(exitcode, expected):
    assert exit_code_for(failure(0, exitcode)) == expected


# ---------------------------------------------------------------- frames


def test_user_frame_skips_ddprun_runpy_torch_and_stdlib_frames(tmp_path):
    callstack = "\n".join([
        "Traceback (most recent call last):",
        f'  File "{BOOTSTRAP}", line 129, in main',
        '  File "<frozen runpy>", line 291, in run_path',
        f'  File "{tmp_path}/train.py", line 9, in <module>',
        "    run()",
        f'  File "{tmp_path}/pkg/loop.py", line 21, in run',
        "    out = ddp(x)",
        f'  File "{SITE}/torch/nn/parallel/distributed.py", line 1700, in forward',
        "    return self._run(x)",
        f'  File "{STDLIB}/json/__init__.py", line 346, in loads',
        "    return _default_decoder.decode(s)",
        "ValueError: boom",
    ])
    err = error_file(tmp_path / "e.json", "ValueError: boom", callstack=callstack, ms=T0 * 1000)
    (cause,) = failures_from_torch({0: process_failure(0, 1, error=err)}, stderr_logs={},
                                   cwd=tmp_path)
    assert cause.user_frame == "pkg/loop.py:21 in run"
    assert cause.user_line == "out = ddp(x)"


def test_user_frame_comes_from_the_last_exception_of_a_chain(tmp_path):
    first = traceback_text(tmp_path, "KeyError: 'lr'")
    callstack = (
        first
        + "\nDuring handling of the above exception, another exception occurred:\n\n"
        + "Traceback (most recent call last):\n"
        + f'  File "{tmp_path}/config.py", line 7, in load\n'
        + "    raise ConfigError('missing lr')\n"
        + "ConfigError: missing lr\n"
    )
    err = error_file(tmp_path / "e.json", "ConfigError: missing lr", callstack=callstack,
                     ms=T0 * 1000)
    logs = {0: log(tmp_path / "r0.log", "start\n" + callstack)}
    (cause,) = failures_from_torch({0: process_failure(0, 1, error=err)}, stderr_logs=logs,
                                   cwd=tmp_path)
    assert cause.user_frame == "config.py:7 in load"
    # Both chained tracebacks fold into one marker line.
    assert cause.stderr_tail == ("start", "... ConfigError traceback (18 lines), summarized above")


def test_syntax_error_points_at_the_users_line(tmp_path):
    callstack = (
        f'  File "{tmp_path}/train.py", line 3\n    def f(\n         ^\n'
        "SyntaxError: '(' was never closed\n"
    )
    err = error_file(tmp_path / "e.json", "SyntaxError: '(' was never closed",
                     callstack=callstack, ms=T0 * 1000)
    (cause,) = failures_from_torch({0: process_failure(0, 1, error=err)}, stderr_logs={},
                                   cwd=tmp_path)
    assert cause.user_frame == "train.py:3"
    assert cause.user_line == "def f("


def test_is_user_file():
    assert is_user_file("/home/me/project/train.py")
    assert is_user_file("train.py")
    assert not is_user_file(BOOTSTRAP)
    assert not is_user_file("<frozen runpy>")
    assert not is_user_file(f"{STDLIB}/runpy.py")
    assert not is_user_file(f"{SITE}/torch/nn/modules/module.py")
    assert not is_user_file("/opt/pytorch/torch/distributed/distributed_c10d.py")
    assert not is_user_file("/usr/lib/python3/dist-packages/numpy/core/fromnumeric.py")


# ---------------------------------------------------------------- error files


def test_error_file_written_by_torchs_own_record_is_read_in_whole_seconds(tmp_path):
    err = error_file(tmp_path / "e.json", "OSError: disk full",
                     callstack=traceback_text(tmp_path, "OSError: disk full"), ms=None)
    (cause,) = failures_from_torch({0: process_failure(0, 1, error=err)}, stderr_logs={})
    assert cause.timestamp == T0
    assert (cause.exc_type, cause.exc_message) == ("OSError", "disk full")


def test_error_file_is_read_when_the_failure_did_not_load_it(tmp_path):
    err = error_file(tmp_path / "e.json", "ValueError: late", callstack="", ms=T0 * 1000 + 5)
    bare = SimpleNamespace(local_rank=0, pid=1, exitcode=1, error_file=str(err), timestamp=T0)
    (cause,) = failures_from_torch({4: bare}, stderr_logs={})
    assert (cause.rank, cause.exc_type, cause.timestamp) == (4, "ValueError", T0 + 0.005)


def test_unreadable_error_file_is_treated_as_no_record(tmp_path):
    broken = tmp_path / "e.json"
    broken.write_text("")  # a writer killed mid-write
    bare = SimpleNamespace(local_rank=0, pid=1, exitcode=1, error_file=str(broken), timestamp=T0)
    (cause,) = failures_from_torch({0: bare}, stderr_logs={})
    assert not cause.recorded and cause.timestamp == T0


def test_flat_message_format(tmp_path):
    flat = SimpleNamespace(local_rank=0, pid=1, exitcode=1, error_file="x", timestamp=T0,
                           error_file_data={"message": "worker lost", "timestamp": T0 - 5})
    (cause,) = failures_from_torch({0: flat}, stderr_logs={})
    assert (cause.exc_type, cause.exc_message, cause.timestamp) == (None, "worker lost", T0 - 5)
    assert "Rank 0 failed: worker lost" in render([cause])


# ---------------------------------------------------------------- stderr tail


def test_stderr_tail_keeps_the_last_20_lines_and_cleans_them(tmp_path):
    lines = [f"[rank1]: line {i}" for i in range(30)]
    lines.append("train 10%|#\rtrain 50%|#####\rtrain 100%|##########")
    logs = {1: log(tmp_path / "r1.log", "\n".join(lines) + "\n\n")}
    (cause,) = failures_from_torch({1: process_failure(1, 3)}, stderr_logs=logs)
    assert len(cause.stderr_tail) == 20
    assert cause.stderr_tail[0] == "line 11"
    assert cause.stderr_tail[-1] == "train 100%|##########"


def test_stderr_tail_reads_only_the_end_of_a_huge_log(tmp_path):
    path = tmp_path / "r0.log"
    path.write_text("x" * 100 + "\n" + ("noise\n" * 100_000) + "last words\n")
    (cause,) = failures_from_torch({0: process_failure(0, 1)}, stderr_logs={0: path})
    assert cause.stderr_tail[-1] == "last words"
    assert "x" * 100 not in cause.stderr_tail


def test_a_traceback_printed_earlier_is_kept_when_the_final_one_is_missing(tmp_path):
    caught = traceback_text(tmp_path, "TimeoutError: retrying")
    err = error_file(tmp_path / "e.json", "ValueError: final", callstack="", ms=T0 * 1000)
    logs = {0: log(tmp_path / "r0.log", caught + "gave up\n")}
    (cause,) = failures_from_torch({0: process_failure(0, 1, error=err)}, stderr_logs=logs)
    assert "TimeoutError: retrying" in cause.stderr_tail
    assert cause.stderr_tail[-1] == "gave up"


def test_only_a_folded_traceback_leaves_no_stderr_section(tmp_path):
    tb = traceback_text(tmp_path, "ValueError: x")
    err = error_file(tmp_path / "e.json", "ValueError: x", callstack=tb, ms=T0 * 1000)
    logs = {0: log(tmp_path / "r0.log", tb)}
    (cause,) = failures_from_torch({0: process_failure(0, 1, error=err)}, stderr_logs=logs)
    assert cause.stderr_tail == ()
    assert "stderr" not in render([cause])


def test_qualified_exception_names_and_multiline_messages_fold(tmp_path):
    printed = traceback_text(tmp_path, "torch.OutOfMemoryError: CUDA out of memory.\nTried 2 GiB")
    err = error_file(tmp_path / "e.json", "OutOfMemoryError: CUDA out of memory.\nTried 2 GiB",
                     callstack=printed, ms=T0 * 1000)
    logs = {0: log(tmp_path / "r0.log", printed + "after\n")}
    (cause,) = failures_from_torch({0: process_failure(0, 1, error=err)}, stderr_logs=logs)
    assert cause.stderr_tail == (
        "... OutOfMemoryError traceback (12 lines), summarized above", "after",
    )
    assert "lower the batch size" in render([cause])


# ---------------------------------------------------------------- the panel


def test_panel_is_compact_and_says_where_logs_are():
    cause = failure(1, 1, exc_type="ValueError", exc_message="bad", user_frame="train.py:4 in f",
                    stderr_tail=tuple(f"line {i}" for i in range(20)))
    others = [failure(r, -15) for r in (0, 2, 3, 5)]
    text = render([*others, cause], attempt=2)
    assert "ddprun: job failed (restart 2)" in text
    assert "Ranks 0, 2-3, 5 stopped after rank 1 failed." in text
    assert len(text.splitlines()) <= 32


def test_panel_without_kept_logs_says_how_to_keep_them():
    text = render([failure(0, 3)], log_location=None)
    assert "--log-dir" in text


def test_panel_prints_user_text_literally():
    cause = failure(0, 1, exc_type="ValueError", exc_message="[bold]not markup[/bold]",
                    stderr_tail=("[red]raw[/red]",))
    text = render([cause])
    assert "[bold]not markup[/bold]" in text
    assert "[red]raw[/red]" in text


def test_panel_shortens_a_long_message_and_lists_many_failed_ranks():
    long = "\n".join(f"detail {i}" for i in range(40))
    cause = failure(0, 1, exc_type="RuntimeError", exc_message=long, timestamp=T0)
    others = [failure(r, 1, timestamp=T0 + r) for r in range(1, 7)]
    text = render([cause, *others])
    assert "detail 5" in text and "detail 6" not in text
    assert "Also failed: rank 1 (exit 1), rank 2 (exit 1), rank 3 (exit 1) and 3 more." in text


def test_exit_code_above_128_names_the_signal_a_shell_reported():
    text = render([failure(0, 137)])
    assert "128 + 9" in text and "SIGKILL" in text and "out-of-memory" in text


def test_argparse_exit_code_2_hint_only_after_a_usage_message():
    rejected = ("usage: train.py [-h] [--lr LR]", "train.py: error: unrecognized arguments: --lrr")
    assert "argparse" in render([failure(0, 2, stderr_tail=rejected)])
    explained = ("ddprun train: error: --data /nope: no such directory",)
    assert "argparse" not in render([failure(0, 2, stderr_tail=explained)])


def test_rank_ranges():
    assert rank_ranges([5, 0, 1, 2, 7, 8]) == "0-2, 5, 7-8"
    assert rank_ranges([3]) == "3"


def test_report_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, ddprun.report; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(report.__file__).parent.parent, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ValueError: bad: worse", ("ValueError", "bad: worse")),
        ("StopIteration: ", ("StopIteration", "")),
        ("StopIteration", ("StopIteration", "")),
        ("worker lost: retry later", (None, "worker lost: retry later")),
        ("", (None, "")),
    ],
)
def test_split_exception(text, expected):
    assert report.split_exception(text) == expected


def test_exception_without_message_shows_just_its_type():
    text = render([failure(0, 1, exc_type="StopIteration", exc_message="")])
    (headline,) = [line.strip("│ ") for line in text.splitlines() if "Rank 0" in line]
    assert headline == "Rank 0 failed: StopIteration"


def test_summarize_gives_one_line_for_restart_messages():
    assert report.summarize(failure(1, -9)) == "rank 1 was killed by SIGKILL"
    assert report.summarize(failure(0, 3)) == "rank 0 exited with code 3"
    multi = failure(2, 1, exc_type="RuntimeError", exc_message="CUDA error\nmore detail")
    assert report.summarize(multi) == "rank 2 failed: RuntimeError: CUDA error"


def test_the_bundled_trainer_s_refusal_keeps_exit_2():
    """ddprun train's workers exit 2 only to refuse bad input they alone can check (a corrupt checkpoint)."""
    assert exit_code_for(failure(0, 2), bundled_worker=True) == 2
    assert exit_code_for(failure(0, 2)) == 1
    assert exit_code_for(failure(0, -9), bundled_worker=True) == 1
