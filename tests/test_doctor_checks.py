"""ddprun.doctor.checks: every check's logic on given facts, broken environments included."""

from __future__ import annotations

import pytest

from ddprun.devices import Gpu, VisibleGpu
from ddprun.doctor import checks
from ddprun.doctor.checks import (
    DESTROY_HINT,
    FAIL,
    GIB,
    NCCL_ERROR_HINT,
    OK,
    PORT_HINT,
    SHM_HINT,
    SKIP,
    WARN,
    CheckResult,
    Progress,
    TorchGpu,
)
from ddprun.errors import UsageError
from gpu_stub import FOUR_GPUS

INVENTORY = [Gpu(index=i, uuid=u, name=n, memory_mib=m) for i, u, n, m in FOUR_GPUS]
INTERFACES = {"lo": ("127.0.0.1", "::1"), "eth0": ("10.1.2.3", "fe80::1"), "ib0": ("192.168.10.3",)}
MIB = 1 << 20


# --- helpers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, size",
    [("8", 8), ("1024", 1024), ("64K", 64 << 10), ("64M", 64 << 20), ("64m", 64 << 20), ("1G", 1 << 30),
     ("1GiB", 1 << 30), ("64MB", 64 << 20), ("1.5G", 3 << 29), (" 2 g ", 2 << 30)],
)
def test_parse_size(text, size):
    assert checks.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "M", "64X", "-1M", "1e6", "64 M B", "4"])
def test_parse_size_rejects_with_an_example(text):
    with pytest.raises(UsageError) as caught:
        checks.parse_size(text)
    assert "64M" in caught.value.message


def test_human_bytes():
    assert checks.human_bytes(8) == "8 B"
    assert checks.human_bytes(64 << 20) == "64 MiB"
    assert checks.human_bytes(1536) == "1.5 KiB"
    assert checks.human_bytes(1 << 30) == "1 GiB"


def test_cuda_wheel_tag_follows_the_driver():
    assert checks.cuda_wheel_tag("580.65.06") == "cu130"
    assert checks.cuda_wheel_tag("550.54.15") == "cu126"
    assert checks.cuda_wheel_tag("470.82.01") is None
    assert "whl/cu126" in checks.install_hint("550.54.15")
    assert "upgrade the NVIDIA driver" in checks.install_hint("470.82.01")


def test_driver_supports():
    assert checks.driver_supports(driver_version="550.54.15", cuda_build="12.4")
    assert not checks.driver_supports(driver_version="550.54.15", cuda_build="13.0")
    assert checks.driver_supports(driver_version="580.65.06", cuda_build="13.0")
    assert not checks.driver_supports(driver_version="515.65.01", cuda_build="12.1")


# --- system ----------------------------------------------------------------------------------


def test_python_and_os():
    assert checks.check_python(version="3.11.7", executable="/usr/bin/python3").status == OK
    assert checks.check_os(system="Linux", release="6.1", machine="x86_64").status == OK
    mac = checks.check_os(system="Darwin", release="23.0", machine="arm64")
    assert mac.status == WARN and "gloo" in mac.hint


def test_cpu_and_memory():
    assert checks.check_cpu(cores=8, affinity=4).detail == "8 cores, 4 usable by this process"
    assert checks.check_cpu(cores=None, affinity=None).status == SKIP
    assert checks.check_memory(total_bytes=64 * GIB, available_bytes=60 * GIB).status == OK
    low = checks.check_memory(total_bytes=4 * GIB, available_bytes=GIB // 2)
    assert low.status == WARN and low.hint


def test_small_shm_warns_with_the_container_hint():
    result = checks.check_shm(total_bytes=64 * MIB, free_bytes=64 * MIB)
    assert result.status == WARN
    assert "64 MiB total" in result.detail
    assert "--shm-size=8g" in result.hint and "--ipc=host" in result.hint


def test_full_shm_warns_too():
    assert checks.check_shm(total_bytes=16 * GIB, free_bytes=100 * MIB).status == WARN


def test_shm_ok_and_missing():
    assert checks.check_shm(total_bytes=16 * GIB, free_bytes=16 * GIB).status == OK
    assert checks.check_shm(total_bytes=None, free_bytes=None).status == SKIP


def test_open_files_limit():
    assert checks.check_open_files(soft=65536, hard=65536).status == OK
    assert checks.check_open_files(soft=None, hard=None).status == OK  # unlimited
    low = checks.check_open_files(soft=1024, hard=1048576)
    assert low.status == WARN and "ulimit -n 65536" in low.hint
    capped = checks.check_open_files(soft=1024, hard=1024)
    assert "ulimit -n 1024" in capped.hint and "limits.conf" in capped.hint


def test_memlock_matters_with_infiniband_only():
    assert checks.check_memlock(soft=None, hard=None, infiniband_devices=["mlx5_0"]).status == OK
    without_ib = checks.check_memlock(soft=8 * MIB, hard=8 * MIB, infiniband_devices=[])
    assert without_ib.status == OK and "8 MiB" in without_ib.detail
    with_ib = checks.check_memlock(soft=64 << 10, hard=64 << 10, infiniband_devices=["mlx5_0"])
    assert with_ib.status == WARN and "ulimit -l unlimited" in with_ib.hint and "mlx5_0" in with_ib.detail


# --- PyTorch ---------------------------------------------------------------------------------


def test_torch_versions():
    result = checks.check_torch(version="2.5.1+cu124", cuda_build="12.4", cudnn="9.1.0", nccl="2.21.5", error=None)
    assert result.status == OK
    assert result.detail == "torch 2.5.1+cu124 (CUDA 12.4, cuDNN 9.1.0, NCCL 2.21.5)"
    cpu = checks.check_torch(version="2.5.1+cpu", cuda_build=None, cudnn=None, nccl=None, error=None)
    assert "CPU-only build" in cpu.detail
    missing = checks.check_torch(version=None, cuda_build=None, cudnn=None, nccl=None, error="No module named 'torch'")
    assert missing.status == FAIL and "pip install torch" in missing.hint


def test_torchvision_pairs_with_torch():
    assert checks.check_torchvision(version="0.20.1", torch_version="2.5.1").status == OK
    mismatch = checks.check_torchvision(version="0.19.0", torch_version="2.5.1")
    assert mismatch.status == WARN and "torchvision==0.20.*" in mismatch.hint
    assert checks.check_torchvision(version=None, torch_version="2.5.1").status == WARN


def test_backends():
    assert checks.check_backends(gloo=True, nccl=True, mpi=False, gpus_usable=True).detail == "available: gloo, nccl"
    assert checks.check_backends(gloo=False, nccl=False, mpi=False, gpus_usable=False).status == FAIL
    assert checks.check_backends(gloo=True, nccl=False, mpi=False, gpus_usable=True).status == WARN
    assert checks.check_backends(gloo=True, nccl=False, mpi=False, gpus_usable=False).status == OK


def test_cpu_only_torch_with_a_driver_fails_with_the_install_hint():
    result = checks.check_torch_cuda_build(cuda_build=None, driver_version="550.54.15")
    assert result.status == FAIL
    assert "CPU-only torch" in result.detail and "550.54.15" in result.detail
    assert "pip install --force-reinstall torch torchvision --index-url https://download.pytorch.org/whl/cu126" in result.hint


def test_cuda_build_newer_than_the_driver_fails():
    result = checks.check_torch_cuda_build(cuda_build="13.0", driver_version="550.54.15")
    assert result.status == FAIL
    assert "needs driver >= 580.65" in result.detail
    assert "whl/cu126" in result.hint


def test_cuda_build_without_a_driver_is_fine():
    assert checks.check_torch_cuda_build(cuda_build="13.0", driver_version=None).status == OK
    assert checks.check_torch_cuda_build(cuda_build=None, driver_version=None).status == OK
    assert checks.check_torch_cuda_build(cuda_build="12.4", driver_version="550.54.15").status == OK


# --- GPUs ------------------------------------------------------------------------------------


def test_no_gpu_machine_skips():
    assert checks.check_driver(driver_version=None, gpu_count=0).status == SKIP
    assert checks.check_visible_devices(value=None, inventory=[]).status == SKIP
    assert checks.check_device_count(torch_count=0, visible_count=0, cuda_build="13.0", driver_version=None).status == SKIP
    assert checks.check_p2p(matrix=None, visible_count=0).status == SKIP


def test_malformed_visible_devices_fails_with_the_validators_message():
    result = checks.check_visible_devices(value="0,x", inventory=INVENTORY)
    assert result.status == FAIL
    assert 'entry "x" is not a GPU index' in result.detail
    assert "CUDA_VISIBLE_DEVICES=0,1" in result.hint


def test_visible_devices_out_of_range_fails():
    result = checks.check_visible_devices(value="0,7", inventory=INVENTORY)
    assert result.status == FAIL and "out of range" in result.detail


def test_malformed_visible_devices_without_gpus_only_warns():
    assert checks.check_visible_devices(value="abc", inventory=[]).status == WARN


def test_visible_devices_listed():
    result = checks.check_visible_devices(value="2,0", inventory=INVENTORY)
    assert result.status == OK
    assert result.detail.startswith('"2,0": cuda:0 = GPU 2 (NVIDIA H100 80GB HBM3, 81559 MiB), cuda:1 = GPU 0')
    hidden = checks.check_visible_devices(value="-1", inventory=INVENTORY)
    assert hidden.status == WARN and "hides every GPU" in hidden.detail


def test_gpu_line():
    visible = VisibleGpu(entry="1", gpu=INVENTORY[1])
    torch_gpu = TorchGpu(ordinal=0, name=INVENTORY[1].name, uuid=INVENTORY[1].uuid, capability=(9, 0))
    result = checks.check_gpu(ordinal=0, visible=visible, torch_gpu=torch_gpu, arch_list=["sm_80", "sm_90"])
    assert result.status == OK and result.name == "cuda:0"
    assert "GPU 1 (NVIDIA H100 80GB HBM3, 81559 MiB)" in result.detail
    assert INVENTORY[1].uuid in result.detail and "compute capability 9.0" in result.detail


def test_gpu_without_kernels_in_this_torch_fails():
    visible = VisibleGpu(entry="0", gpu=INVENTORY[0])
    torch_gpu = TorchGpu(ordinal=0, name="NVIDIA B200", uuid=INVENTORY[0].uuid, capability=(10, 0))
    result = checks.check_gpu(ordinal=0, visible=visible, torch_gpu=torch_gpu, arch_list=["sm_80", "sm_90"])
    assert result.status == FAIL and "sm_100" in result.hint


@pytest.mark.parametrize(
    "capability, arch_list, supported",
    [((9, 0), ["sm_80", "sm_90"], True), ((8, 6), ["sm_80"], True), ((8, 9), ["sm_90"], False),
     ((12, 0), ["sm_90", "compute_90"], True), ((12, 0), ["sm_90a", "sm_100"], False), ((7, 0), [], True),
     ((9, 0), ["gfx90a"], True)],
)
def test_arch_supported(capability, arch_list, supported):
    assert checks.arch_supported(capability, arch_list) is supported


def test_device_count_mismatch_with_cpu_only_torch():
    result = checks.check_device_count(torch_count=0, visible_count=4, cuda_build=None, driver_version="550.54.15")
    assert result.status == FAIL
    assert "device_count() = 0" in result.detail and "4 visible" in result.detail
    assert "whl/cu126" in result.hint


def test_device_count_mismatch_with_a_cuda_torch():
    result = checks.check_device_count(torch_count=0, visible_count=2, cuda_build="12.4", driver_version="550.54.15")
    assert result.status == FAIL and "--gpus all" in result.hint
    partial = checks.check_device_count(torch_count=1, visible_count=2, cuda_build="12.4", driver_version="550.54.15")
    assert partial.status == WARN
    same = checks.check_device_count(torch_count=2, visible_count=2, cuda_build="12.4", driver_version="550.54.15")
    assert same.status == OK


def test_device_count_not_compared_for_invalid_visible_devices():
    assert checks.check_device_count(torch_count=0, visible_count=None, cuda_build="12.4", driver_version="550").status == SKIP


def test_p2p_matrix():
    full = [[True] * 4 for _ in range(4)]
    assert checks.check_p2p(matrix=full, visible_count=4).status == OK
    partial = [[True, True, False], [True, True, True], [False, True, True]]
    result = checks.check_p2p(matrix=partial, visible_count=3)
    assert result.status == WARN and "cuda:0<->2" in result.detail and "nvidia-smi topo -m" in result.hint
    blind = checks.check_p2p(matrix=None, visible_count=4)
    assert blind.status == SKIP and "torch cannot use" in blind.detail


# --- network ---------------------------------------------------------------------------------


def test_hostname_resolving_to_loopback_warns():
    result = checks.check_hostname(hostname="node1", addresses=["127.0.1.1"], error=None, interfaces=INTERFACES)
    assert result.status == WARN
    assert "127.0.1.1" in result.detail and "loopback" in result.detail
    assert "multi-node" in result.hint and "map node1 to 10.1.2.3 in /etc/hosts" in result.hint


def test_hostname_resolving_elsewhere_is_ok():
    result = checks.check_hostname(hostname="node1", addresses=["10.1.2.3"], error=None, interfaces=INTERFACES)
    assert result.status == OK and result.detail == "node1 -> 10.1.2.3"


def test_unresolvable_hostname_warns():
    result = checks.check_hostname(hostname="node1", addresses=[], error="Name or service not known", interfaces={})
    assert result.status == WARN and "does not resolve" in result.detail


def test_interfaces():
    assert checks.check_interfaces(interfaces=INTERFACES).status == OK
    assert checks.check_interfaces(interfaces={"lo": ("127.0.0.1",)}).status == WARN
    assert checks.check_interfaces(interfaces={}).status == SKIP


@pytest.mark.parametrize(
    "spec, selected",
    [("eth0", ["eth0"]), ("eth", ["eth0"]), ("e", ["eth0"]), ("=eth", []), ("=eth0", ["eth0"]),
     ("^lo", ["eth0", "ib0"]), ("^lo,ib", ["eth0"]), ("^=eth", ["lo", "eth0", "ib0"]), ("ib0,eth0", ["eth0", "ib0"]),
     ("docker", [])],
)
def test_select_interfaces_nccl_syntax(spec, selected):
    assert checks.select_interfaces(spec, list(INTERFACES)) == selected


def test_select_interfaces_gloo_takes_exact_names():
    assert checks.select_interfaces("eth", list(INTERFACES), nccl_syntax=False) == []
    assert checks.select_interfaces("eth0,ib0", list(INTERFACES), nccl_syntax=False) == ["eth0", "ib0"]


def test_nccl_socket_ifname_naming_no_interface_fails():
    result = checks.check_socket_ifname(variable="NCCL_SOCKET_IFNAME", value="enp5s0", interfaces=INTERFACES)
    assert result.status == FAIL
    assert "matches no interface" in result.detail and "lo, eth0, ib0" in result.detail
    assert "NCCL_SOCKET_IFNAME=eth0" in result.hint and "'^'" in result.hint


def test_nccl_socket_ifname_excluding_everything_fails():
    result = checks.check_socket_ifname(variable="NCCL_SOCKET_IFNAME", value="^lo,eth,ib", interfaces=INTERFACES)
    assert result.status == FAIL


def test_socket_ifname_ok_and_unset():
    ok = checks.check_socket_ifname(variable="NCCL_SOCKET_IFNAME", value="^lo,docker", interfaces=INTERFACES)
    assert ok.status == OK and ok.detail.endswith("selects eth0, ib0")
    assert checks.check_socket_ifname(variable="GLOO_SOCKET_IFNAME", value=None, interfaces=INTERFACES).status == OK


def test_gloo_socket_ifname_needs_exact_existing_names():
    result = checks.check_socket_ifname(variable="GLOO_SOCKET_IFNAME", value="eth0,eth1", interfaces=INTERFACES)
    assert result.status == FAIL and "eth1" in result.detail and "exact interface names" in result.hint
    assert checks.check_socket_ifname(variable="GLOO_SOCKET_IFNAME", value="eth0", interfaces=INTERFACES).status == OK


def test_master_addr():
    assert checks.check_master_addr(value=None, addresses=[], error=None).status == OK
    ok = checks.check_master_addr(value="node0", addresses=["10.1.2.4"], error=None)
    assert ok.status == OK and "10.1.2.4" in ok.detail
    bad = checks.check_master_addr(value="nodo0", addresses=[], error="Name or service not known")
    assert bad.status == FAIL and "MASTER_ADDR=nodo0 does not resolve" in bad.detail and bad.hint


def test_busy_port_warns_and_names_the_holder():
    result = checks.check_port(port=29500, free=False, holder="pid 4242 (python3)")
    assert result.status == WARN
    assert "pid 4242 (python3)" in result.detail
    assert result.hint == PORT_HINT and "--port 29501" in result.hint
    assert checks.check_port(port=29500, free=False, holder=None).status == WARN
    assert checks.check_port(port=29500, free=True, holder=None).status == OK


# --- environment -----------------------------------------------------------------------------


def test_env_listing():
    env = {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "HOME": "/root", "PET_NNODES": "2", "OMP_PROC_BIND": "true"}
    assert checks.check_env_listing(env=env).detail == "NCCL_DEBUG=INFO, OMP_NUM_THREADS=4, PET_NNODES=2"
    assert checks.check_env_listing(env={"HOME": "/root"}).detail.startswith("no NCCL_*")


def combos(env, *, p2p_works=None, ib=(), cores=8) -> dict[str, CheckResult]:
    found = checks.check_env_combinations(env=env, p2p_works=p2p_works, infiniband_devices=list(ib), cores=cores)
    return {result.name: result for result in found}


def test_p2p_disabled_where_p2p_works_warns():
    found = combos({"NCCL_P2P_DISABLE": "1"}, p2p_works=True)
    assert found["NCCL_P2P_DISABLE"].status == WARN and "Unset NCCL_P2P_DISABLE" in found["NCCL_P2P_DISABLE"].hint
    assert combos({"NCCL_P2P_DISABLE": "1"}, p2p_works=False) == {}
    assert combos({"NCCL_P2P_DISABLE": "1"}, p2p_works=None) == {}


def test_known_bad_combinations():
    assert "NCCL_IB_DISABLE" in combos({"NCCL_IB_DISABLE": "1"}, ib=["mlx5_0"])
    assert combos({"NCCL_IB_DISABLE": "1"}) == {}
    assert "NCCL_SHM_DISABLE" in combos({"NCCL_SHM_DISABLE": "1"})
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" in combos({"NCCL_ASYNC_ERROR_HANDLING": "1"})["NCCL_ASYNC_ERROR_HANDLING"].hint
    assert "CUDA_LAUNCH_BLOCKING" in combos({"CUDA_LAUNCH_BLOCKING": "1"})
    assert "TORCH_DISTRIBUTED_DEBUG" in combos({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    assert combos({"NCCL_DEBUG": "INFO", "TORCH_DISTRIBUTED_DEBUG": "INFO", "OMP_NUM_THREADS": "4"}) == {}


def test_omp_and_master_port():
    assert combos({"OMP_NUM_THREADS": "16"}, cores=8)["OMP_NUM_THREADS"].status == WARN
    assert combos({"OMP_NUM_THREADS": "four"})["OMP_NUM_THREADS"].status == WARN
    assert combos({"MASTER_PORT": "http"})["MASTER_PORT"].status == FAIL
    assert combos({"MASTER_PORT": "70000"})["MASTER_PORT"].status == FAIL
    assert combos({"MASTER_PORT": "29501"}) == {}


# --- smoke test results ----------------------------------------------------------------------


def test_progress_round_trip():
    text = checks.format_progress(pid=123, index=4, step="all_reduce float32")
    assert checks.parse_progress(1, text) == Progress(rank=1, pid=123, index=4, step="all_reduce float32")
    assert checks.parse_progress(0, "") is None
    assert checks.parse_progress(0, "garbage") is None


def test_describe_hang_names_the_least_advanced_step():
    progress = [Progress(0, 10, 5, "barrier"), Progress(1, 11, 4, "broadcast")]
    step, where = checks.describe_hang(progress, nranks=2)
    assert step == "broadcast"
    assert where == "barrier (rank 0); broadcast (rank 1)"


def test_describe_hang_with_ranks_missing():
    step, where = checks.describe_hang([Progress(0, 10, 1, "init_process_group")], nranks=2)
    assert step is None and "not started (rank 1)" in where
    assert checks.describe_hang([], nranks=2) == (None, "no rank had started (of 2)")


REPORT = {
    "backend": "gloo",
    "world_size": 2,
    "device": "CPU",
    "steps": [
        {"name": "init_process_group", "status": "ok", "detail": "gloo, 2 ranks, CPU"},
        {"name": "all_reduce bfloat16", "status": "skip", "detail": "gloo does not support bfloat16"},
        {"name": "destroy_process_group", "status": "ok", "detail": "clean shutdown"},
    ],
    "bandwidth": [],
}


def smoke(**overrides) -> list[CheckResult]:
    arguments = dict(
        report=REPORT, returncode=0, timed_out=False, timeout_s=60.0, progress=[], output_tail="", backend="gloo", nranks=2
    )
    arguments.update(overrides)
    return checks.check_smoke(**arguments)


def test_smoke_pass():
    results = smoke()
    assert [r.status for r in results] == [OK, OK, SKIP, OK]
    assert results[0].name == "smoke test" and "every check passed" in results[0].detail
    assert "destroy_process_group() too" in results[-1].detail


def test_smoke_timeout_names_the_step_that_hung():
    partial = dict(REPORT, steps=REPORT["steps"][:1])
    progress = [Progress(0, 1, 3, "all_reduce float32"), Progress(1, 2, 3, "all_reduce float32")]
    results = smoke(report=partial, returncode=-15, timed_out=True, progress=progress, backend="nccl")
    last = results[-1]
    assert last.status == FAIL and last.name == "smoke test"
    assert "no end within 60 s" in last.detail and "Hung in all_reduce float32" in last.detail
    assert "NCCL_DEBUG=INFO" in last.hint and "CUDA_VISIBLE_DEVICES" in last.hint


def test_smoke_timeout_at_init_points_at_the_network():
    progress = [Progress(0, 1, 1, "init_process_group"), Progress(1, 2, 1, "init_process_group")]
    last = smoke(report=None, returncode=None, timed_out=True, progress=progress)[-1]
    assert "Hung in init_process_group" in last.detail and "GLOO_SOCKET_IFNAME" in last.hint


def test_smoke_timeout_at_shutdown_names_destroy_process_group():
    progress = [Progress(0, 1, 20, "destroy_process_group"), Progress(1, 2, 20, "destroy_process_group")]
    last = smoke(report=None, returncode=None, timed_out=True, progress=progress)[-1]
    assert "destroy_process_group" in last.detail and DESTROY_HINT in last.hint


def test_smoke_timeout_after_every_step_blames_the_exit():
    progress = [Progress(0, 1, 21, "exit"), Progress(1, 2, 21, "exit")]
    last = smoke(timed_out=True, returncode=-15, progress=progress)[-1]
    assert "Hung in exit" in last.detail and "did not exit in time" in last.hint


def test_smoke_crash_before_reporting():
    tail = "RuntimeError: The server socket has failed to listen on any local network address. port: 29500, useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use"
    last = smoke(report=None, returncode=1, output_tail=tail)[-1]
    assert last.status == FAIL and "exited with code 1 before reporting" in last.detail
    assert last.hint == PORT_HINT


def test_smoke_failed_step_gets_a_hint():
    report = dict(REPORT, steps=[{"name": "init_process_group", "status": "fail", "detail": "DistBackendError: NCCL error: invalid usage, Duplicate GPU detected"}])
    results = smoke(report=report, returncode=1, backend="nccl")
    assert results[0].status == FAIL and results[0].hint == NCCL_ERROR_HINT
    assert results[-1].status == FAIL


@pytest.mark.parametrize(
    "text, hint",
    [("Bus error (core dumped)", SHM_HINT), ("No space left on device: /dev/shm/nccl-x", SHM_HINT),
     ("ProcessGroupNCCL: process group has NOT been destroyed", DESTROY_HINT), ("ncclUnhandledCudaError", NCCL_ERROR_HINT)],
)
def test_failure_hints(text, hint):
    assert checks.failure_hint(text, backend="gloo") == hint


def test_bandwidth_summary():
    rows = [
        {"bytes": 8, "time_us": 100.0, "algbw_gbps": 0.00008, "busbw_gbps": 0.00008},
        {"bytes": 1 << 20, "time_us": 1000.0, "algbw_gbps": 1.05, "busbw_gbps": 1.05},
    ]
    result = checks.check_bandwidth(rows=rows, backend="gloo", nranks=2)
    assert result.status == OK and "peak busbw 1.05 GB/s" in result.detail and "1 MiB" in result.detail
    assert checks.check_bandwidth(rows=[], backend="gloo", nranks=2).status == SKIP


RANK1_FAILED = dict(REPORT, steps=[{"name": "init_process_group", "status": "fail",
                                    "detail": "RuntimeError: nccl needs one GPU per rank"}])


def test_a_failure_only_another_rank_recorded_is_reported_with_its_rank():
    # The launcher stopped rank 0 before it wrote anything: rank 1's failure stands alone.
    merged = checks.with_other_ranks_failure(None, {1: RANK1_FAILED})
    assert merged["steps"] == [{"name": "init_process_group", "status": "fail",
                                "detail": "rank 1: RuntimeError: nccl needs one GPU per rank"}]
    assert merged["backend"] == "gloo" and smoke(report=merged, returncode=1)[0].status == FAIL
    # Rank 0 got further: its steps stay, the other rank's failure follows them.
    partial = dict(REPORT, steps=REPORT["steps"][:1])
    assert [s["status"] for s in checks.with_other_ranks_failure(partial, {1: RANK1_FAILED})["steps"]] == [OK, FAIL]


def test_rank_0s_own_failure_wins_and_other_ranks_without_failures_change_nothing():
    own = dict(REPORT, steps=[{"name": "broadcast", "status": "fail", "detail": "1 rank(s) received wrong values"}])
    assert checks.with_other_ranks_failure(own, {1: RANK1_FAILED}) is own
    assert checks.with_other_ranks_failure(REPORT, {1: REPORT}) is REPORT
    assert checks.with_other_ranks_failure(None, {}) is None
