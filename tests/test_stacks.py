"""Stacks on demand without a launch: faulthandler dumps parsed, grouped and rendered; a real
signal round trip with a plain Python process; finding jobs; stall decisions; plan options."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from ddprun import runfolders, stacks, stall
from ddprun.errors import UsageError
from ddprun.plan import Entrypoint, LaunchOptions, build_plan
from ddprun.envnames import STACKS_FILE_ENV

TORCH = "/venv/lib/python3.11/site-packages/torch/distributed"
DUMP_RANK0 = f'''Thread 0x00007f63146be6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f6315422b80 (most recent call first):
  File "{TORCH}/distributed_c10d.py", line 3913 in all_reduce
  File "{TORCH}/c10d_logger.py", line 83 in wrapper
  File "/home/u/proj/train.py", line 88 in step
  File "/home/u/proj/train.py", line 120 in <module>
  File "<frozen runpy>", line 88 in _run_code
'''
DUMP_RANK1 = '''Current thread 0x00007f6315422b80 (most recent call first):
  File "/home/u/proj/data.py", line 40 in load
  File "/home/u/proj/train.py", line 87 in step
  File "/home/u/proj/train.py", line 120 in <module>
'''


def answered(rank: int, dump: str) -> stacks.RankStacks:
    return stacks.RankStacks(rank, "answered", stacks.parse_dump(dump), pid=100 + rank)


def plain(renderable) -> str:
    console = Console(width=300, record=True, file=open(os.devnull, "w"))
    console.print(renderable)
    return console.export_text()


# --- parsing ----------------------------------------------------------------------------------


def test_a_faulthandler_dump_becomes_threads_with_frames_outermost_first():
    threads = stacks.parse_dump(DUMP_RANK0)
    assert [t.ident for t in threads] == ["0x00007f63146be6c0", "0x00007f6315422b80"]
    assert [t.current for t in threads] == [False, True]
    main = threads[-1]
    assert main.frames[0].func == "_run_code" and main.frames[-1] == stacks.Frame(f"{TORCH}/distributed_c10d.py", 3913, "all_reduce")


def test_a_second_dump_appended_meanwhile_does_not_double_the_threads():
    assert len(stacks.parse_dump(DUMP_RANK0 + "\n" + DUMP_RANK0)) == 2
    assert stacks.parse_dump("garbage\n  File \"x.py\", line 1 in f\n") == ()


def test_the_sigcgt_mask_says_whether_a_signal_is_caught():
    status = "Name:\tpython\nSigBlk:\t0000000000000000\nSigCgt:\t0000010000004002\n"
    assert stacks.catches_signal(status, 41)  # bit 40
    assert stacks.catches_signal(status, 2) and stacks.catches_signal(status, 15)
    assert not stacks.catches_signal(status, 10)
    assert not stacks.catches_signal("Name:\tx\n", 41)


# --- summaries and groups ---------------------------------------------------------------------


def test_the_summary_names_the_user_frame_and_what_it_calls():
    assert stacks.where(stacks.parse_dump(DUMP_RANK0)[-1]) == "train.py:88 in step -> all_reduce"
    assert stacks.where(stacks.parse_dump(DUMP_RANK1)[-1]).startswith("data.py:40 in load")


def test_a_user_line_that_calls_into_c_names_the_call(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\n\nx = 1\ntime . sleep(3600)  # stuck\n")
    thread = stacks.Thread("0x1", True, (stacks.Frame(str(script), 4, "<module>"),))
    assert stacks.where(thread) == "hang.py:4 in <module> -> time.sleep"
    assert stacks.where(stacks.Thread("0x1", True, (stacks.Frame(str(script), 3, "<module>"),))) == "hang.py:3 in <module>"


def test_identical_stacks_share_one_line_and_ranks_are_written_as_ranges():
    snapshot = [answered(r, DUMP_RANK0) for r in (0, 2, 3, 4, 7)] + [answered(1, DUMP_RANK1)]
    snapshot.append(stacks.RankStacks(5, "exited", pid=105, exitcode=-9))
    snapshot.append(stacks.RankStacks(6, "not answering", pid=106, detail="no answer within 2 s"))
    lines = [stacks.summary_line(g) for g in stacks.group(snapshot)]
    assert lines == [
        "ranks 0,2-4,7: train.py:88 in step -> all_reduce",
        "rank 1: data.py:40 in load",
        "rank 5: exited (code -9)",
        "rank 6: not answering (no answer within 2 s)",
    ]


def test_rendering_shows_the_summary_then_each_group_with_user_frames_bold():
    snapshot = [answered(0, DUMP_RANK0), answered(1, DUMP_RANK1)]
    group = stacks.render(snapshot)
    text = plain(group)
    assert text.index("rank 0: train.py:88") < text.index("rank 1: data.py:40") < text.index("main thread")
    assert "<frozen runpy>" not in text  # the launch frames are left out
    assert 'File "torch/distributed/distributed_c10d.py", line 3913, in all_reduce' in text
    frames = {t.plain.strip().split(",")[0]: t.style for t in group.renderables if hasattr(t, "plain")}
    assert frames['File "/home/u/proj/train.py"'] == "bold"
    assert frames['File "torch/distributed/distributed_c10d.py"'] == "dim"
    assert "thread 0x00007f63146be6c0" in text  # every thread, the main one first


def test_json_lists_every_rank_with_its_state():
    data = json.loads(stacks.to_json([answered(0, DUMP_RANK0), stacks.RankStacks(1, "exited", exitcode=3)]))
    assert data[0]["where"] == "train.py:88 in step -> all_reduce" and data[1] == {**data[1], "state": "exited", "exitcode": 3}


# --- collective timeouts ----------------------------------------------------------------------


@pytest.mark.parametrize("message", [
    "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation to complete",
    "DistBackendError: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE)",
    "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234",
])
def test_collective_timeouts_are_recognised(message):
    assert stacks.looks_like_collective_timeout(message)
    assert not stacks.looks_like_collective_timeout("ValueError: bad shape")


def test_the_rank_outside_the_collective_is_the_likely_cause():
    sleeping = answered(1, DUMP_RANK1)
    snapshot = [stacks.RankStacks(0, "exited", exitcode=1), sleeping, answered(2, DUMP_RANK0)]
    assert stacks.culprit_lines(snapshot, failed_rank=0) == [
        "Likely cause: rank 1: data.py:40 in load (not inside a collective)"]
    inside = stacks.culprit_lines([answered(2, DUMP_RANK0)], failed_rank=0)
    assert inside[0].startswith("Every other rank was inside a collective: rank 2: train.py:88")
    assert stacks.culprit_lines([], failed_rank=0) == []


def test_nccl_flight_recorder_dumps_give_each_rank_s_last_collective(tmp_path):
    folder = tmp_path / "nccl_trace"
    folder.mkdir()
    entries = [{"collective_seq_id": 11, "profiling_name": "nccl:all_reduce", "state": "completed"},
               {"collective_seq_id": 12, "profiling_name": "nccl:all_reduce", "state": "started"}]
    (folder / "rank_0").write_bytes(pickle.dumps({"version": "2.4", "pg_config": {}, "entries": entries}))
    (folder / "rank_1").write_bytes(pickle.dumps({"entries": entries[:1]}))
    (folder / "rank_2").write_bytes(pickle.dumps({"entries": [Path("x")]}))  # a class: refused, still listed
    records = stacks.flight_records(str(folder / "rank_"))
    assert [(r.rank, r.last_seq, r.last_state) for r in records] == [(0, 12, "started"), (1, 11, "completed"), (2, None, None)]
    lines = stacks.flight_record_lines(records, folder=str(folder))
    assert lines[1] == "  rank 0: last collective #12 nccl:all_reduce (started)"
    assert lines[-1] == f"  analyse them with: torchfrtrace {folder} -p rank_"


# --- a real round trip, without torch ---------------------------------------------------------

_RANK = """
import os, sys, time
from ddprun.worker import stackdump
stackdump.install()
open(sys.argv[1], "w").write(str(os.getpid()))
def wait_here():
    time.sleep(60)
wait_here()
"""


def test_a_process_with_the_dump_installed_answers_and_an_exited_rank_shows_its_code(tmp_path):
    attempt = tmp_path / "attempt_0"
    attempt.mkdir()
    env = dict(os.environ, **{STACKS_FILE_ENV: str(attempt / "rank_0.stacks")})
    rank0 = subprocess.Popen([sys.executable, "-c", _RANK, str(attempt / "rank_0.pid")], env=env)
    try:
        deadline = time.monotonic() + 20
        while not stacks.catches_signal(Path(f"/proc/{rank0.pid}/status").read_text(), stacks.stacks_signal()):
            assert time.monotonic() < deadline, "the dump was never installed"
            time.sleep(0.05)
        while not (attempt / "rank_0.pid").read_text() if (attempt / "rank_0.pid").exists() else True:
            time.sleep(0.05)
        (attempt / "rank_1.pid").write_text("999999")
        stacks.write_exit_record(attempt, 1, -9)
        (attempt / "rank_2.pid").write_text("")
        snapshot = stacks.collect(attempt, timeout_s=2)
        assert [s.state for s in snapshot] == ["answered", "exited", "not started"]
        assert stacks.summary_line([snapshot[0]]) == "rank 0: <string>:7 in wait_here"
        assert snapshot[0].main.frames[-1].func == "wait_here"
        assert stacks.summary_line([snapshot[1]]) == "rank 1: exited (code -9)"
        assert oct((attempt / "rank_0.stacks").stat().st_mode & 0o777) == "0o600"
        assert rank0.poll() is None  # asking twice does not hurt it
        assert stacks.collect(attempt, timeout_s=2)[0].state == "answered" and rank0.poll() is None
    finally:
        rank0.kill()
        rank0.wait()
    assert stacks.collect(attempt, timeout_s=1)[0].state == "exited"


def test_a_process_without_the_dump_is_never_signalled(tmp_path):
    attempt = tmp_path / "attempt_0"
    attempt.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)
        (attempt / "rank_0.pid").write_text(str(other.pid))
        [result] = stacks.collect(attempt, timeout_s=0.5)
        assert result.state == "not answering" and "not set up" in result.detail
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


# --- finding the job --------------------------------------------------------------------------


def make_job(root: Path, name: str, *, pid: int | None = None) -> Path:
    import psutil
    import socket

    folder = root / name
    (folder / "attempt_0").mkdir(parents=True)
    pid = pid or os.getpid()
    record = {"pid": pid, "host": socket.gethostname(), "started": psutil.Process(pid).create_time()}
    (folder / runfolders.MARKER).write_text(json.dumps(record))
    return folder


def test_no_running_job_and_an_unknown_id_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="no running ddprun job of yours"):
        stacks.find_job(None, roots=[str(tmp_path)], uid=os.getuid())
    with pytest.raises(UsageError, match="ddprun-0123456789ab: no such job"):
        stacks.find_job("ddprun-0123456789ab", roots=[str(tmp_path)], uid=os.getuid())


def test_the_only_running_job_is_picked_and_several_are_listed(tmp_path):
    job = make_job(tmp_path, "ddprun-aaaaaaaaaaaa")
    assert stacks.find_job(None, roots=[str(tmp_path)], uid=os.getuid()) == job
    assert stacks.find_job("ddprun-aaaaaaaaaaaa", roots=[str(tmp_path)], uid=os.getuid()) == job
    assert stacks.find_job(str(job), roots=[], uid=os.getuid()) == job
    make_job(tmp_path, "ddprun-bbbbbbbbbbbb")
    with pytest.raises(UsageError, match="2 jobs are running: .*ddprun-aaaaaaaaaaaa.*ddprun-bbbbbbbbbbbb"):
        stacks.find_job(None, roots=[str(tmp_path)], uid=os.getuid())
    assert stacks.latest_attempt(job) == job / "attempt_0"
    (job / "attempt_1").mkdir()
    (job / "attempt_1.2").mkdir()
    assert stacks.latest_attempt(job) == job / "attempt_1.2"


def test_an_ended_job_is_not_running(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    job = tmp_path / "ddprun-cccccccccccc"
    (job / "attempt_0").mkdir(parents=True)
    (job / runfolders.MARKER).write_text(json.dumps({"pid": int(done.stdout), "host": "x", "started": 1.0}))
    with pytest.raises(UsageError, match="not running any more"):
        stacks.find_job(str(job), roots=[], uid=os.getuid())
    assert runfolders.running_jobs(str(tmp_path), uid=os.getuid()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_another_user_s_job_is_refused(tmp_path):
    import pwd

    job = make_job(tmp_path, "ddprun-dddddddddddd")
    nobody = pwd.getpwnam("nobody")
    for path in (job, job / runfolders.MARKER):
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(UsageError, match="belongs to another user"):
        stacks.find_job(str(job), roots=[], uid=os.getuid())
    assert runfolders.running_jobs(str(tmp_path), uid=os.getuid()) == []


# --- the stall watch's decisions --------------------------------------------------------------


def test_a_stall_is_reported_once_after_the_timeout_and_again_only_after_progress():
    clock = stall.StallClock(10.0)
    assert clock.observe("a", 0.0) is None
    assert clock.observe("a", 9.9) is None
    assert clock.observe("a", 10.5) == 10.5
    assert clock.observe("a", 30.0) is None  # once per stall
    assert clock.observe("b", 31.0) is None  # it moved on
    assert clock.observe("b", 41.5) == 10.5 and clock.samples == 2


def test_sampling_is_four_times_per_timeout_within_bounds():
    assert [stall.sample_interval(t) for t in (1, 10, 300, 3600)] == [0.5, 2.5, 30.0, 30.0]


def test_output_progress_and_stacks_all_count_as_advancing(tmp_path):
    (tmp_path / "rank_0.stdout.log").write_text("a")
    progress = tmp_path / "progress.jsonl"
    snap = [answered(0, DUMP_RANK0)]
    first = stall.progress_mark(tmp_path, progress_path=str(progress), snapshot=snap)
    assert stall.progress_mark(tmp_path, progress_path=str(progress), snapshot=snap) == first
    (tmp_path / "rank_0.stacks").write_text("dumps do not count")
    assert stall.progress_mark(tmp_path, progress_path=str(progress), snapshot=snap) == first
    assert stall.progress_mark(tmp_path, progress_path=str(progress), snapshot=[answered(0, DUMP_RANK1)]) != first
    progress.write_text('{"step": 1233, "total": 5000}\n{"step": 1234, "total": 5000}\n')
    assert stall.progress_mark(tmp_path, progress_path=str(progress), snapshot=snap) != first
    (tmp_path / "rank_0.stdout.log").write_text("ab")
    assert stall.progress_mark(tmp_path, progress_path=str(progress), snapshot=snap) != first
    os.utime(progress, (time.time() - 300, time.time() - 300))
    assert stall.trainer_line(str(progress), now=time.time()) == "rank 0 has not recorded a step after step 1234 for 300 s"
    assert stall.trainer_line(str(tmp_path / "missing"), now=0) is None


# --- the plan ---------------------------------------------------------------------------------


def plan(torch_version="2.14.1", **options):
    return build_plan(LaunchOptions(entrypoint=Entrypoint("train.py"), **options), env={}, inventory=[],
                      cpu_count=2, job_id="ddprun-000000000001", log_root="/tmp/r", rdzv_secret="s",
                      torch_version=torch_version)


@pytest.mark.parametrize("value", [0.0, -1.0])
def test_a_stall_timeout_must_be_positive(value):
    with pytest.raises(UsageError, match="--stall-timeout"):
        plan(stall_timeout_s=value)


def test_stall_options_reach_the_plan():
    p = plan(stall_timeout_s=300.0, on_stall="kill")
    assert (p.stall_timeout_s, p.on_stall) == (300.0, "kill")
    assert (plan().stall_timeout_s, plan().on_stall) == (None, "report")
    with pytest.raises(UsageError, match="--on-stall stop: choose report"):
        plan(on_stall="stop")


def test_sigquit_is_ddprun_s_from_torch_2_10_and_torch_s_before():
    new = plan().launch
    assert "SIGQUIT" not in new.torch_signals and new.stacks_on_sigquit
    old = plan(torch_version="2.4.0").launch
    assert "SIGQUIT" in old.torch_signals and not old.stacks_on_sigquit


def test_every_rank_is_told_where_its_stacks_go():
    assert STACKS_FILE_ENV in plan().launch.launch_env


def test_nccl_jobs_get_the_flight_recorder_unless_the_user_set_it():
    from ddprun.plan import _flight_recorder_env

    env = _flight_recorder_env("nccl", env={}, job_folder="/tmp/r/job")
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/r/job/nccl_trace/rank_"}
    assert _flight_recorder_env("gloo", env={}, job_folder="/x") == {}
    kept = _flight_recorder_env("nccl", env={"TORCH_FR_BUFFER_SIZE": "100", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"},
                                job_folder="/x")
    assert kept == {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/nccl_trace/rank_"}
