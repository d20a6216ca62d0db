"""ddprun.doctor.main and render: facts to checks, the smoke launch, output, and real runs on this machine."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from rich.console import Console

from ddprun.devices import Gpu, VisibleGpu
from ddprun.doctor import checks, main, probe, render
from ddprun.doctor.checks import FAIL, OK, SKIP, WARN, CheckResult, TorchGpu
from ddprun.errors import UsageError
from gpu_stub import FOUR_GPUS, install_stub_nvidia_smi, path_with

INVENTORY = tuple(Gpu(index=i, uuid=u, name=n, memory_mib=m) for i, u, n, m in FOUR_GPUS)
GPU_CHECKS = ("NVIDIA driver", "CUDA_VISIBLE_DEVICES", "torch sees the GPUs", "GPU peer-to-peer", "torch CUDA build")
DOCTOR_ENV_PREFIXES = ("NCCL_", "GLOO_", "MASTER_", "PET_", "TORCH_", "CUDA_", "OMP_NUM_THREADS", "DDPRUN_")


def make_facts(*, torch: dict | None = None, net: dict | None = None, system: dict | None = None, **top) -> probe.Facts:
    """A healthy CPU-only machine, changed where a test says."""
    system_facts = probe.SystemFacts(
        python_version="3.11.7", executable="/usr/bin/python3", system="Linux", release="6.1", machine="x86_64",
        cores=8, affinity=8, mem_total=64 << 30, mem_available=60 << 30, shm_total=32 << 30, shm_free=32 << 30,
        nofile=(65536, 65536), memlock=(None, None), infiniband=(),
    )
    torch_facts = probe.TorchFacts(
        version="2.5.1+cu124", cuda_build="12.4", cudnn="9.1.0", nccl="2.21.5", torchvision="0.20.1",
        gloo=True, nccl_available=True, device_count=0,
    )
    net_facts = probe.NetFacts(
        hostname="node1", host_addresses=("10.1.2.3",), host_error=None,
        interfaces={"lo": ("127.0.0.1",), "eth0": ("10.1.2.3",)}, master_addr_addresses=(), master_addr_error=None,
        port=29500, port_free=True, port_holder=None,
    )
    base = probe.Facts(
        system=dataclasses.replace(system_facts, **(system or {})),
        torch=dataclasses.replace(torch_facts, **(torch or {})),
        net=dataclasses.replace(net_facts, **(net or {})),
        inventory=(),
        driver_version=None,
        env={},
    )
    return dataclasses.replace(base, **top)


def by_name(results) -> dict[str, CheckResult]:
    return {result.name: result for result in results}


# --- facts -> checks -------------------------------------------------------------------------


def test_healthy_cpu_machine_has_no_warning_or_failure():
    results = main.evaluate(make_facts())
    assert {r.status for r in results} <= {OK, SKIP}
    assert main.exit_code(results, strict=True) == 0
    found = by_name(results)
    assert found["NVIDIA driver"].status == SKIP and found["torch sees the GPUs"].status == SKIP


def test_gpu_machine_with_cpu_only_torch_reports_the_mismatch():
    facts = make_facts(
        torch={"version": "2.5.1+cpu", "cuda_build": None, "cudnn": None, "nccl": None, "nccl_available": False},
        inventory=INVENTORY,
        driver_version="550.54.15",
    )
    found = by_name(main.evaluate(facts))
    assert found["torch CUDA build"].status == FAIL and "whl/cu126" in found["torch CUDA build"].hint
    assert found["torch sees the GPUs"].status == FAIL and "4 visible" in found["torch sees the GPUs"].detail
    assert [f"cuda:{i}" in found for i in range(4)] == [True] * 4
    assert found["GPU peer-to-peer"].status == SKIP
    assert main.exit_code(list(found.values()), strict=False) == 1


def test_gpus_are_matched_to_torch_by_uuid():
    # CUDA numbered the two cards the other way round; capabilities still land on the right card.
    torch_gpus = (
        TorchGpu(ordinal=0, name=INVENTORY[1].name, uuid=INVENTORY[1].uuid, capability=(9, 0)),
        TorchGpu(ordinal=1, name=INVENTORY[0].name, uuid=INVENTORY[0].uuid, capability=(8, 0)),
    )
    visible = VisibleGpu(entry="0", gpu=INVENTORY[0])
    assert main.match_torch_gpu(visible, 0, torch_gpus) is torch_gpus[1]
    assert main.match_torch_gpu(VisibleGpu(entry="MIG-x", gpu=None), 1, torch_gpus) is torch_gpus[1]
    assert main.match_torch_gpu(visible, 3, ()) is None


def test_healthy_gpu_machine():
    torch_gpus = tuple(TorchGpu(ordinal=i, name=g.name, uuid=g.uuid, capability=(9, 0)) for i, g in enumerate(INVENTORY[:2]))
    facts = make_facts(
        torch={"device_count": 2, "gpus": torch_gpus, "arch_list": ("sm_90",), "p2p": ((True, True), (True, True))},
        inventory=INVENTORY,
        driver_version="550.54.15",
        env={"CUDA_VISIBLE_DEVICES": "0,1", "NCCL_P2P_DISABLE": "1"},
    )
    found = by_name(main.evaluate(facts))
    assert found["cuda:1"].status == OK and "compute capability 9.0" in found["cuda:1"].detail
    assert found["torch sees the GPUs"].status == OK and found["GPU peer-to-peer"].status == OK
    assert found["NCCL_P2P_DISABLE"].status == WARN  # P2P works, so disabling it only costs speed


def test_broken_environment_fails_where_it_should():
    facts = make_facts(
        system={"shm_total": 64 << 20, "shm_free": 64 << 20},
        net={"host_addresses": ("127.0.1.1",), "port_free": False, "port_holder": "pid 9 (python3)"},
        inventory=INVENTORY,
        driver_version="550.54.15",
        env={"CUDA_VISIBLE_DEVICES": "0,,1", "NCCL_SOCKET_IFNAME": "ib", "MASTER_ADDR": "nodo0"},
    )
    facts = dataclasses.replace(facts, net=dataclasses.replace(facts.net, master_addr_error="Name or service not known"))
    found = by_name(main.evaluate(facts))
    expected = {
        "/dev/shm": WARN, "hostname": WARN, "port 29500": WARN, "CUDA_VISIBLE_DEVICES": FAIL,
        "NCCL_SOCKET_IFNAME": FAIL, "MASTER_ADDR": FAIL, "torch sees the GPUs": SKIP,
    }
    assert {name: found[name].status for name in expected} == expected
    assert all(found[name].hint for name, status in expected.items() if status != SKIP)


def test_options_that_cannot_work_are_usage_errors():
    with pytest.raises(UsageError, match="--timeout 0"):
        main.run_doctor(timeout_s=0)
    with pytest.raises(UsageError, match="--max-bytes 4"):
        main.run_doctor(max_bytes=4)


def test_exit_code():
    warn = [CheckResult("a", OK, ""), CheckResult("b", WARN, "", hint="h")]
    assert main.exit_code(warn, strict=False) == 0
    assert main.exit_code(warn, strict=True) == 1
    assert main.exit_code(warn + [CheckResult("c", FAIL, "")], strict=False) == 1


def test_smoke_plan_on_cpu_and_on_gpus():
    cpu = main.plan_smoke(make_facts(), max_bytes=None, timeout_s=60.0)
    assert (cpu.nranks, cpu.backend, cpu.launch_flags) == (2, "gloo", ("--nproc", "2", "--cpu"))
    assert cpu.smoke_flags == ("--backend", "gloo", "--timeout", "45", "--sweep-budget", "15")
    argv = main.smoke_argv(cpu, out=Path("/t/o.json"), progress_dir=Path("/t/p"), log_dir=Path("/t/logs"))
    assert argv == [
        sys.executable, "-m", "ddprun", "run", "--nproc", "2", "--cpu", "--log-dir", "/t/logs",
        "-m", "ddprun.doctor.smoke", "--", "--backend", "gloo", "--timeout", "45", "--sweep-budget", "15",
        "--out", "/t/o.json", "--progress-dir", "/t/p",
    ]
    gpu = main.plan_smoke(make_facts(torch={"device_count": 4}), max_bytes=1 << 20, timeout_s=60.0)
    assert (gpu.nranks, gpu.backend, gpu.launch_flags) == (4, "nccl", ("--gpus", "all"))
    assert gpu.smoke_flags[-2:] == ("--max-bytes", str(1 << 20))


def test_smoke_env_puts_this_ddprun_first():
    env = main.smoke_env({"PYTHONPATH": "/elsewhere"})
    first = env["PYTHONPATH"].split(os.pathsep)[0]
    assert (Path(first) / "ddprun" / "doctor" / "main.py").is_file()
    assert env["PYTHONPATH"].endswith("/elsewhere") and env["PYTHONUNBUFFERED"] == "1"


# --- the hard timeout ------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_timeout_stops_the_launcher_and_workers_in_their_own_session(tmp_path):
    progress_dir = tmp_path / "progress"
    progress_dir.mkdir()
    # A stand-in launcher: starts a "worker" in a session of its own (as torch elastic does), records
    # it like the smoke worker would, then hangs.
    launcher = textwrap.dedent(f"""
        import subprocess, sys, time
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "ddprun.doctor.smoke"], start_new_session=True)
        open({str(progress_dir / "rank0")!r}, "w").write(f"{{worker.pid}} 3 all_reduce float32\\n")
        time.sleep(120)
    """)
    started = time.monotonic()
    returncode, timed_out, progress = main.launch(
        [sys.executable, "-c", launcher], log_path=tmp_path / "log", timeout_s=3.0, progress_dir=progress_dir
    )
    assert timed_out and returncode is not None
    assert [(p.rank, p.step) for p in progress] == [(0, "all_reduce float32")]
    assert time.monotonic() - started < 3.0 + main.STOP_GRACE_S + 2
    time.sleep(0.2)
    assert not _alive(progress[0].pid)


def test_launch_returns_the_exit_code(tmp_path):
    (tmp_path / "p").mkdir()
    result = main.launch([sys.executable, "-c", "print('hi'); raise SystemExit(3)"], log_path=tmp_path / "log", timeout_s=30, progress_dir=tmp_path / "p")
    assert result == (3, False, [])
    assert main.read_tail(tmp_path / "log").strip() == "hi"


# --- output ----------------------------------------------------------------------------------

ROWS = [{"bytes": 8, "time_us": 150.0, "algbw_gbps": 0.00005, "busbw_gbps": 0.00005, "extra": 1}]


def test_json_shape():
    results = [CheckResult("a", OK, "fine"), CheckResult("b", WARN, "meh", hint="do x")]
    data = json.loads(render.to_json(results, ROWS))
    assert data == {
        "checks": [
            {"name": "a", "status": "ok", "detail": "fine", "hint": None},
            {"name": "b", "status": "warn", "detail": "meh", "hint": "do x"},
        ],
        "bandwidth": [{"bytes": 8, "time_us": 150.0, "algbw_gbps": 0.00005, "busbw_gbps": 0.00005}],
    }


def test_table_shows_hints_for_warn_and_fail_only():
    console = Console(file=io.StringIO(), width=200, color_system=None)
    results = [
        CheckResult("port 29500", WARN, "in use by pid 9 [python3]", hint="use --port 29501"),
        CheckResult("torch", OK, "torch 2.5.1", hint="never shown"),
        CheckResult("MASTER_ADDR", FAIL, "does not resolve", hint="set MASTER_ADDR"),
    ]
    render.render(console, results=results, bandwidth=ROWS, bandwidth_title="all_reduce bandwidth", strict=False)
    text = console.file.getvalue()
    assert "! │ port 29500" in text and "✓ │ torch" in text and "✗ │ MASTER_ADDR" in text
    assert "→ use --port 29501" in text and "→ set MASTER_ADDR" in text and "never shown" not in text
    assert "[python3]" in text  # details are text, not markup
    assert "busbw (GB/s)" in text and "8 B" in text
    assert "Not ready for DDP: 1 failed, 1 warning" in text


# --- real runs on this machine ---------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(DOCTOR_ENV_PREFIXES):
            monkeypatch.delenv(name)


def _json_run(capsys, **options) -> tuple[int, dict]:
    code = main.run_doctor(as_json=True, console=Console(file=io.StringIO()), **options)
    return code, json.loads(capsys.readouterr().out)


def test_doctor_without_smoke_on_this_machine(clean_env, capsys):
    code, data = _json_run(capsys, smoke=False)
    found = {check["name"]: check for check in data["checks"]}
    assert data["bandwidth"] == []
    assert found["torch"]["status"] == "ok" and found["python"]["status"] == "ok"
    assert not any(name.startswith("smoke") for name in found)
    if found["NVIDIA driver"]["status"] == "skip":  # no GPU here: GPU checks never fail
        assert all(found[name]["status"] in ("ok", "skip", "warn") for name in GPU_CHECKS)
    assert code == (1 if any(c["status"] == "fail" for c in data["checks"]) else 0)


def test_stub_gpus_on_a_cpu_only_torch_report_the_mismatch(clean_env, capsys, monkeypatch, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("real GPUs here: the driver's NVML answers, not the stub")
    monkeypatch.setenv("PATH", path_with(install_stub_nvidia_smi(tmp_path / "bin", FOUR_GPUS).parent))
    code, data = _json_run(capsys, smoke=False)
    found = {check["name"]: check for check in data["checks"]}
    assert code == 1
    assert found["NVIDIA driver"]["detail"] == "driver 550.54.15, 4 GPUs"
    assert found["torch sees the GPUs"]["status"] == "fail"
    assert "the driver shows 4 visible" in found["torch sees the GPUs"]["detail"]
    assert found["torch sees the GPUs"]["hint"]
    assert found["cuda:3"]["detail"].startswith("GPU 3 (NVIDIA H100 80GB HBM3, 81559 MiB)")


def test_full_doctor_with_the_smoke_test_passes_on_gloo(clean_env, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("GPUs here: the smoke test runs on nccl")
    code, data = _json_run(capsys, smoke=True, max_bytes=1 << 20, timeout_s=90.0)
    found = {check["name"]: check for check in data["checks"]}
    assert found["smoke test"]["status"] == "ok", found["smoke test"]
    for step in ("init_process_group", "all_reduce float32", "all_reduce int64", "broadcast", "barrier", "destroy_process_group"):
        assert found[f"smoke: {step}"]["status"] == "ok", found[f"smoke: {step}"]
    sizes = [row["bytes"] for row in data["bandwidth"]]
    assert sizes == [8 << i for i in range(18)]  # 8 B doubling up to 1 MiB
    assert all(set(row) == {"bytes", "time_us", "algbw_gbps", "busbw_gbps"} for row in data["bandwidth"])
    assert all(row["time_us"] > 0 and row["busbw_gbps"] == pytest.approx(row["algbw_gbps"]) for row in data["bandwidth"])
    assert code == (1 if any(c["status"] == "fail" for c in data["checks"]) else 0)


def test_smoke_failure_comes_back_as_a_failed_step(clean_env):
    # nccl asked of CPU-only ranks: every rank fails at init; rank 0 still reports which step and why.
    plan = main.SmokePlan(
        launch_flags=("--nproc", "2", "--cpu"),
        smoke_flags=("--backend", "nccl", "--timeout", "20"),
        nranks=2,
        backend="nccl",
        timeout_s=90.0,
    )
    import torch

    if torch.cuda.is_available():
        pytest.skip("GPUs here: nccl would work")
    found = by_name(main.run_smoke(plan).results)
    init = found["smoke: init_process_group"]
    assert init.status == FAIL and "nccl needs one GPU per rank" in init.detail, init
    assert init.hint == checks.NCCL_ERROR_HINT
    assert found["smoke test"].status == FAIL and "exited with code" in found["smoke test"].detail
    assert "smoke: destroy_process_group" not in found  # the group never started


def test_smoke_sweep_arithmetic():
    from ddprun.doctor import smoke

    assert smoke.bus_bandwidth(10.0, 2) == 10.0
    assert smoke.bus_bandwidth(10.0, 8) == pytest.approx(17.5)
    assert smoke.bus_bandwidth(10.0, 1) == 0.0
    assert smoke.iterations(8, gpu=False) == (3, 50)
    assert smoke.iterations(64 << 20, gpu=False) == (1, 4)
    assert smoke.iterations(1 << 30, gpu=True) == (1, 8)


def test_read_report_takes_another_ranks_failure_when_rank_0_wrote_none(tmp_path):
    out = tmp_path / "smoke.json"
    failure = {"backend": "gloo", "steps": [{"name": "init_process_group", "status": "fail", "detail": "boom"}]}
    Path(checks.rank_report_path(str(out), 2)).write_text(json.dumps(failure))
    assert main.read_report(out, nranks=2) is None  # rank 2 is not part of a 2-rank job
    report = main.read_report(out, nranks=3)
    assert report["steps"] == [{"name": "init_process_group", "status": "fail", "detail": "rank 2: boom"}]
