"""The one room for torch's internals: each feature check, and its fallback with the feature missing."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ddprun import torch_internals as ti
from ddprun.errors import UsageError
from tests.conftest import run_ddprun

ROOT = Path(__file__).resolve().parents[1]


# --- versions --------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("2.14.1", (2, 14)), ("2.4.0+cu121", (2, 4)), ("2.9.0a0+git1234", (2, 9)), ("3.0.0", (3, 0)),
])
def test_versions_are_read_as_major_minor(text, expected):
    assert ti.parse_version(text) == expected


def test_a_torch_below_the_floor_is_refused_naming_both_versions():
    with pytest.raises(UsageError) as error:
        ti.check_torch_version("2.3.1")
    assert "torch 2.3.1 is installed" in error.value.message and ">= 2.4" in error.value.message


def test_no_torch_is_refused():
    with pytest.raises(UsageError, match="torch is not installed"):
        ti.check_torch_version(None)


def test_tested_releases_run_without_a_notice():
    assert ti.check_torch_version("2.4.0") == []
    assert ti.check_torch_version("2.14.1") == []


def test_a_newer_torch_runs_with_one_notice():
    notices = ti.check_torch_version("2.15.0")
    assert len(notices) == 1 and "newer than the newest release ddprun was tested on (2.14)" in notices[0]


def test_the_feature_table_matches_what_the_wheels_hold():
    old, new = ti.features_for("2.4.0"), ti.features_for("2.14.1")
    assert (old.store_implementation, new.store_implementation) == ("legacy", "libuv")
    assert ti.features_for("2.7.0").store_implementation == "legacy"
    assert ti.features_for("2.8.0").store_implementation == "libuv"
    assert not old.launcher_handles_signals and new.launcher_handles_signals
    assert not ti.features_for("2.11.0").launcher_shutdown_timeout and new.launcher_shutdown_timeout
    assert not old.warm_trainer_by_default and new.warm_trainer_by_default


def test_the_installed_version_comes_from_metadata_without_importing_torch():
    code = ("import sys; from ddprun import torch_internals as t; v = t.installed_torch_version(); "
            "print(v, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[1] == "False"
    assert ti.parse_version(out[0]) >= ti.TORCH_FLOOR


def _fake_torch_metadata(tmp_path: Path, version: str) -> dict[str, str]:
    """A dist-info first on the path: importlib.metadata then reports that torch release."""
    info = tmp_path / "fake" / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return {"PYTHONPATH": str(tmp_path / "fake")}


def test_cli_refuses_an_old_torch_before_anything_starts(cpu_env, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit(7)\n")
    done = run_ddprun(["run", "--cpu", str(script)], env={**cpu_env, **_fake_torch_metadata(tmp_path, "2.3.1")})
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) <= 2 and "torch 2.3.1 is installed, but ddprun needs torch >= 2.4" in done.stderr


def test_cli_warns_once_on_a_newer_torch_and_plans_as_usual(cpu_env, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    done = run_ddprun(["run", "--cpu", "--dry-run", "--json", str(script)],
                      env={**cpu_env, **_fake_torch_metadata(tmp_path, "2.99.0")})
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("newer than the newest release") == 1
    assert json.loads(done.stdout)["launch"]["torch_version"] == "2.99.0"


# --- the held store --------------------------------------------------------------------------


class _FakeDist:
    """torch.distributed with a TCPStore that refuses a listening fd on libuv, as 2.4-2.7 do."""

    def __init__(self, *, libuv_takes_fd: bool) -> None:
        self.calls: list[bool] = []
        self.libuv_takes_fd = libuv_takes_fd

    def TCPStore(self, host, port, *, use_libuv, master_listen_fd, **kwargs):  # noqa: N802 - torch's name
        self.calls.append(use_libuv)
        if use_libuv and not self.libuv_takes_fd:
            raise NotImplementedError("The libuv TCPStore backend does not support initialization with an listen fd")
        return ("store", use_libuv, master_listen_fd)


@pytest.fixture
def fake_dist(monkeypatch):
    def install(*, libuv_takes_fd: bool) -> _FakeDist:
        fake = _FakeDist(libuv_takes_fd=libuv_takes_fd)
        module = types.ModuleType("torch.distributed")
        module.TCPStore = fake.TCPStore
        torch = types.ModuleType("torch")
        torch.distributed = module
        monkeypatch.setitem(sys.modules, "torch", torch)
        monkeypatch.setitem(sys.modules, "torch.distributed", module)
        return fake
    return install


def test_libuv_serves_the_held_socket_where_it_can(fake_dist):
    fake = fake_dist(libuv_takes_fd=True)
    assert ti.serve_store_on_socket(5, host="127.0.0.1", port=1, implementation="libuv") == ("store", True, 5)
    assert fake.calls == [True]


def test_the_legacy_store_takes_the_socket_where_libuv_refuses_it(fake_dist):
    fake = fake_dist(libuv_takes_fd=False)
    assert ti.serve_store_on_socket(5, host="127.0.0.1", port=1, implementation="libuv") == ("store", False, 5)
    assert fake.calls == [True, False]


def test_the_plan_can_ask_for_the_legacy_store_directly(fake_dist):
    fake = fake_dist(libuv_takes_fd=False)
    ti.serve_store_on_socket(5, host="127.0.0.1", port=1, implementation="legacy")
    assert fake.calls == [False]


def test_a_real_store_serves_a_held_socket_with_the_installed_torch():
    import torch
    import torch.distributed as dist

    implementation = ti.features_for(torch.__version__).store_implementation
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = ti.serve_store_on_socket(sock.fileno(), host="127.0.0.1", port=sock.getsockname()[1],
                                      implementation=implementation)
    client = dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=False)
    client.set("k", "v")
    assert server.get("k") == b"v"
    if ti.store_owns_socket(implementation):
        sock.detach()  # the legacy store polls it until the process ends: closing it aborts
    else:
        sock.close()


# --- the workers' store and the launch configuration ------------------------------------------


def test_workers_are_pointed_at_ddprun_s_store_as_clients():
    envs = {0: {"MASTER_ADDR": "host.example", "MASTER_PORT": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"}, 1: {}}
    ti.point_workers_at(envs, host="127.0.0.1", port=4242, agent_store=True)
    for env in envs.values():
        assert env == {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4242", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_the_worker_store_hook_is_used_where_the_handler_has_it():
    handler = types.SimpleNamespace(_create_tcp_store_server=None, _backend_name="c10d")
    create = lambda addr, port: None  # noqa: E731
    assert ti.keep_worker_store_local(handler, create, name="ddprun-c10d")
    assert handler._create_tcp_store_server is create and handler._backend_name == "ddprun-c10d"


def test_a_handler_without_the_hook_keeps_torch_s_behaviour():
    handler = types.SimpleNamespace(_backend_name="c10d")  # torch 2.4: its workers' rank 0 hosts
    assert not ti.keep_worker_store_local(handler, lambda a, p: None, name="ddprun-c10d")
    assert handler._backend_name == "c10d"


@dataclasses.dataclass
class _NewConfig:
    shutdown_timeout: int | None = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


@dataclasses.dataclass
class _OldConfig:  # torch 2.4-2.9: neither field
    nproc_per_node: int = 1


def test_launch_config_gets_the_grace_period_and_signals_where_torch_has_them():
    config = _NewConfig()
    assert ti.configure_launch(config, grace_period_s=2.4, torch_signals="SIGQUIT") == []
    assert (config.shutdown_timeout, config.signals_to_handle) == (2, "SIGQUIT")


def test_an_old_launch_config_says_the_grace_period_is_torch_s():
    config = _OldConfig()
    lost = ti.configure_launch(config, grace_period_s=5, torch_signals="SIGHUP")
    assert len(lost) == 1 and "30 s" in lost[0] and "--grace-period 5" in lost[0]
    assert not hasattr(config, "signals_to_handle") and not hasattr(config, "shutdown_timeout")
    assert ti.configure_launch(_OldConfig(), grace_period_s=30, torch_signals="") == []


def test_filtered_log_destinations_only_where_torch_asks_for_them():
    new = types.SimpleNamespace(filtered_stdout="", filtered_stderr="")
    ti.tune_logs_dest(new)
    assert new.filtered_stdout == os.devnull == new.filtered_stderr
    old = types.SimpleNamespace()
    ti.tune_logs_dest(old)
    assert not hasattr(old, "filtered_stdout")


# --- the error file and exit handlers ---------------------------------------------------------


def test_torch_reads_back_the_error_record_ddprun_writes(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    try:
        raise ValueError("bad value")
    except ValueError as exc:
        record = ti.error_record(exc, now=1700000000.25)
    path = tmp_path / "error.json"
    path.write_text(json.dumps(record))
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.error_file_data["message"]["message"] == "ValueError: bad value"
    assert "raise ValueError" in failure.error_file_data["message"]["extraInfo"]["py_callstack"]
    assert failure.timestamp == 1700000000
    assert record["message"]["extraInfo"]["timestamp_ms"] == "1700000000250"


def test_torch_s_excepthook_is_set_aside_and_others_kept(monkeypatch):
    def _distributed_excepthook(*args):  # the name torch.distributed gives its hook
        pass

    monkeypatch.setattr(sys, "excepthook", _distributed_excepthook)
    assert ti.plain_excepthook() is sys.__excepthook__
    mine = lambda *args: None  # noqa: E731
    monkeypatch.setattr(sys, "excepthook", mine)
    assert ti.plain_excepthook() is mine


def test_exit_handlers_run_and_a_python_without_the_hook_is_tolerated(monkeypatch):
    import atexit

    ran = []
    atexit.register(ran.append, 1)
    ti.run_exit_handlers()
    assert ran == [1]
    monkeypatch.delattr(atexit, "_run_exitfuncs")
    ti.run_exit_handlers()  # nothing to call: os._exit then skips the handlers, nothing raises


def _private_attributes(path: Path) -> list[str]:
    """`x._name` uses whose owner is not self/cls, and `os._exit` aside: torch's and Python's internals."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner in ("self", "cls") or (owner, node.attr) == ("os", "_exit"):
                continue
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: import {a.name}"
                      for a in node.names if a.name.startswith("_")]
    return found


def test_no_private_torch_name_outside_this_room():
    offenders = [hit for path in sorted((ROOT / "ddprun").rglob("*.py")) if path.name != "torch_internals.py"
                 for hit in _private_attributes(path)]
    assert not offenders, "\n".join(offenders)


def test_the_dry_run_line_says_which_guarantees_plain_torchrun_would_lose(cpu_env, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    done = run_ddprun(["run", "--cpu", "--dry-run", str(script)], env=cpu_env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and "torchrun " in done.stdout  # stdout: one line, for machines
    assert "this torchrun line loses" in done.stderr and "loopback" in done.stderr
    plan = json.loads(run_ddprun(["run", "--cpu", "--dry-run", "--json", str(script)], env=cpu_env).stdout)
    assert plan["launch"]["fresh_worker_store"] and plan["launch"]["store_bind"] == "127.0.0.1"
    assert plan["job_id"] not in plan["rdzv_id"]  # the rendezvous id is not derived from the job id


def test_a_torch_whose_store_takes_no_held_socket_is_reported_for_the_fallback(fake_dist):
    fake = fake_dist(libuv_takes_fd=False)

    def no_fd_at_all(host, port, *, use_libuv, master_listen_fd, **kwargs):
        fake.calls.append(use_libuv)
        raise TypeError("TCPStore() got an unexpected keyword argument 'master_listen_fd'")

    sys.modules["torch.distributed"].TCPStore = no_fd_at_all
    with pytest.raises(ti.HeldStoreUnsupported, match="master_listen_fd"):
        ti.serve_store_on_socket(5, host="127.0.0.1", port=1, implementation="libuv")


def test_without_a_held_store_the_launch_falls_back_to_torch_s_rendezvous_and_says_what_is_lost(monkeypatch):
    import contextlib

    from ddprun import launch, rendezvous
    from tests.test_plan import plan

    @contextlib.contextmanager
    def unsupported(*args, **kwargs):
        raise ti.HeldStoreUnsupported("TypeError: no master_listen_fd")
        yield

    monkeypatch.setattr(rendezvous, "hold_store", unsupported)
    said = []
    the_plan = plan(cpu=True)
    with launch._held_rendezvous(the_plan, say=said.append) as rdzv:
        assert rdzv.held is None and rdzv.torchrun_args == the_plan.torchrun_args
    assert len(said) == 1 and "torch's own rendezvous" in said[0] and "fresh store per restart" in said[0]


def test_the_declared_floor_is_the_one_ci_installs():
    import re as _re

    declared = _re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    ci = (ROOT / ".ci" / "run").read_text()
    assert ti.parse_version(declared) == ti.TORCH_FLOOR
    assert f'"torch=={ti.TESTED_RELEASES[0]}"' in ci and f"OLDEST_TORCH={ti.TESTED_RELEASES[0]}" in ci
    assert ti.parse_version(ti.TESTED_RELEASES[0]) == ti.TORCH_FLOOR
