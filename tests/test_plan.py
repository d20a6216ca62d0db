"""build_plan is pure: every rule is checked here on given env, inventory and core counts."""

from __future__ import annotations

import json
import shlex

import pytest

from ddprun import cluster
from ddprun.devices import Gpu
from ddprun.errors import UsageError
from ddprun.plan import Entrypoint, LaunchOptions, build_plan

FOUR = [Gpu(i, f"GPU-{i}aaaaaaa-0000-0000-0000-00000000000{i}", "NVIDIA H100", 81559) for i in range(4)]
SCRIPT = Entrypoint("train.py", ("--lr", "0.1"))


def plan(env=None, inventory=(), cpu_count=8, torch_version="2.14.1", **options):
    return build_plan(
        LaunchOptions(entrypoint=options.pop("entrypoint", SCRIPT), **options),
        env=env or {}, inventory=list(inventory), cpu_count=cpu_count, job_id="job-1", log_root="/tmp/ddprun",
        rdzv_secret="secret-1", torch_version=torch_version,
    )


def test_no_gpu_runs_two_cpu_processes_on_gloo_and_says_so():
    p = plan()
    assert (p.backend, p.nproc_per_node, p.world_size, p.devices) == ("gloo", 2, 2, None)
    assert any("No GPU found" in n for n in p.notices)


def test_all_visible_gpus_by_default_on_nccl():
    p = plan(inventory=FOUR)
    assert (p.backend, p.nproc_per_node, p.devices) == ("nccl", 4, ["0", "1", "2", "3"])
    assert p.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert p.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_ordinals_are_translated_to_what_the_variable_held():
    p = plan(env={"CUDA_VISIBLE_DEVICES": "3,1,2"}, inventory=FOUR, gpus="0,2")
    assert p.devices == ["3", "2"]
    assert p.env["CUDA_VISIBLE_DEVICES"] == "3,2"
    assert p.device_labels[0].startswith("cuda:0 = GPU 3")


def test_gpu_count_takes_the_first_n_visible():
    assert plan(inventory=FOUR, gpus="2").devices == ["0", "1"]


def test_nproc_alone_takes_the_first_n_gpus():
    assert plan(inventory=FOUR, nproc=2).devices == ["0", "1"]


def test_more_gpus_than_visible_says_what_to_type():
    with pytest.raises(UsageError) as err:
        plan(env={"CUDA_VISIBLE_DEVICES": "0,1"}, inventory=FOUR, gpus="3")
    assert "3 GPUs requested, but CUDA_VISIBLE_DEVICES=0,1 exposes 2: use --gpus 2" in err.value.message


def test_nproc_must_match_the_selected_gpus():
    with pytest.raises(UsageError, match="one GPU per process"):
        plan(inventory=FOUR, gpus="2", nproc=4)


@pytest.mark.parametrize("bad", ["0", "-1", "abc", "0,0", "0,9"])
def test_bad_gpu_requests(bad):
    with pytest.raises(UsageError):
        plan(inventory=FOUR, gpus=bad)


def test_cpu_flag_wins_over_gpus_present_and_ignores_them():
    p = plan(inventory=FOUR, cpu=True, nproc=3)
    assert (p.backend, p.nproc_per_node, p.devices) == ("gloo", 3, None)
    assert "CUDA_VISIBLE_DEVICES" not in p.env


def test_cpu_and_gpus_exclude_each_other():
    with pytest.raises(UsageError, match="--cpu and --gpus"):
        plan(cpu=True, gpus="1")


def test_nproc_zero():
    with pytest.raises(UsageError, match="--nproc 0"):
        plan(nproc=0)


def test_malformed_visible_devices_is_an_error_even_without_gpus():
    with pytest.raises(UsageError, match="CUDA_VISIBLE_DEVICES"):
        plan(env={"CUDA_VISIBLE_DEVICES": "0,0"})


def test_visible_devices_hiding_every_gpu_falls_back_to_cpu():
    p = plan(env={"CUDA_VISIBLE_DEVICES": "-1"}, inventory=FOUR)
    assert p.backend == "gloo" and "No GPU visible" in p.notices[0]


@pytest.mark.parametrize("cores,nproc,expected", [(8, 2, "4"), (2, 2, "1"), (1, 4, "1"), (16, 3, "5")])
def test_omp_threads_split_the_cores(cores, nproc, expected):
    p = plan(cpu_count=cores, nproc=nproc)
    assert p.env["OMP_NUM_THREADS"] == expected
    assert any("OMP_NUM_THREADS" in n for n in p.notices)


def test_omp_threads_set_by_the_user_is_kept():
    p = plan(env={"OMP_NUM_THREADS": "3"})
    assert "OMP_NUM_THREADS" not in p.env


def test_single_node_rendezvous_is_c10d_on_loopback_with_a_unique_id():
    p = plan(port=29600)
    args = p.torchrun_args
    assert args[args.index("--rdzv-backend") + 1] == "c10d"
    assert args[args.index("--rdzv-endpoint") + 1] == "127.0.0.1:29600"
    assert args[args.index("--rdzv-id") + 1] == "secret-1"  # never the job id, which names a folder
    assert args[args.index("--local-addr") + 1] == "127.0.0.1"
    assert p.store_role == "host" and p.env["GLOO_SOCKET_IFNAME"] == "lo"


def test_without_port_the_endpoint_asks_for_any_free_port():
    assert plan().endpoint == "127.0.0.1:0"


def test_script_arguments_pass_through_unchanged_after_the_bootstrap():
    entry = Entrypoint("train.py", ("--gpus", "3", "--", "--nproc", "x y"))
    args = plan(entrypoint=entry).torchrun_args
    tail = args[args.index("ddprun.worker.bootstrap") + 1:]
    assert tail == ["train.py", "--gpus", "3", "--", "--nproc", "x y"]


def test_module_entrypoint():
    args = plan(entrypoint=Entrypoint("pkg.train", ("a",), is_module=True)).torchrun_args
    assert args[-5:] == ["-m", "ddprun.worker.bootstrap", "-m", "pkg.train", "a"]


def test_shell_command_is_one_copy_pasteable_line():
    p = plan(entrypoint=Entrypoint("my train.py", ("a b",)))
    line = p.shell_command()
    assert "\n" not in line
    words = shlex.split(line)
    assert words[:3] == ["GLOO_SOCKET_IFNAME=lo", "NCCL_SOCKET_IFNAME=lo", "OMP_NUM_THREADS=4"]
    assert words[3] == "torchrun" and words[-2:] == ["my train.py", "a b"]


def test_json_has_the_documented_keys():
    data = json.loads(plan(inventory=FOUR, gpus="2").to_json())
    for key in ("torchrun_args", "env", "nproc_per_node", "nnodes", "world_size", "backend", "devices", "entrypoint"):
        assert key in data
    assert data["devices"] == ["0", "1"] and data["backend"] == "nccl" and data["world_size"] == 2


@pytest.mark.parametrize("ranks", [(2,), (0, 5), (-1,)])
def test_ranks_outside_the_world(ranks):
    with pytest.raises(UsageError, match="outside the world"):
        plan(ranks=ranks)


@pytest.mark.parametrize(
    "option,value,message",
    [("max_restarts", -1, "--max-restarts -1"), ("grace_period_s", -1.0, "--grace-period -1"),
     ("join_timeout_s", 0.0, "--join-timeout 0"), ("forward_signals", ("SIGKILL",), "--forward-signal SIGKILL")],
)
def test_bad_lifecycle_options(option, value, message):
    with pytest.raises(UsageError, match=message):
        plan(**{option: value})


def test_max_restarts_and_join_timeout_reach_torchrun():
    args = plan(max_restarts=2, join_timeout_s=30.0).torchrun_args
    assert args[args.index("--max-restarts") + 1] == "2"
    assert args[args.index("--rdzv-conf") + 1] == "join_timeout=30"


def test_a_ddprun_flag_after_the_script_is_passed_on_but_pointed_out():
    p = plan(entrypoint=Entrypoint("train.py", ("--dry-run",)))
    assert p.torchrun_args[-1] == "--dry-run"
    assert any("--dry-run comes after the script" in n for n in p.notices)


# --- launch-time choices the torchrun line cannot express ---------------------------------------


def test_a_single_node_plan_records_the_held_loopback_store_and_fresh_worker_stores():
    choices = plan().launch
    assert choices.store_bind == "127.0.0.1" and choices.agent_joins_held_store
    assert choices.fresh_worker_store and choices.store_implementation == "libuv"
    assert choices.launcher_env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert {"MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "DDPRUN_PID_FILE", "TORCHELASTIC_ERROR_FILE"} <= set(choices.launch_env)
    assert any("loopback" in lost for lost in choices.lost_in_torchrun_line)
    assert any("restart" in lost for lost in choices.lost_in_torchrun_line)


def test_the_oldest_torch_gets_the_legacy_store_and_torch_s_own_signals_and_grace():
    choices = plan(torch_version="2.4.0", grace_period_s=5).launch
    assert choices.store_implementation == "legacy"
    assert choices.torch_signals == ["SIGHUP", "SIGQUIT"]
    assert not choices.grace_period_honoured
    assert plan(torch_version="2.14.1", grace_period_s=5).launch.grace_period_honoured


def test_a_forwarded_signal_is_left_to_ddprun_where_torch_allows_it():
    # SIGQUIT stays with ddprun too: Ctrl-\ prints the ranks' stacks (ddprun.stall).
    assert plan(forward_signals=("SIGHUP",)).launch.torch_signals == []


def test_forwarding_sighup_on_a_torch_that_takes_it_itself_is_refused():
    with pytest.raises(UsageError, match="--forward-signal SIGHUP needs torch >= 2.10"):
        plan(torch_version="2.9.0", forward_signals=("SIGHUP",))
    assert plan(torch_version="2.9.0", forward_signals=("SIGUSR1",)).launch.torch_signals == ["SIGHUP", "SIGQUIT"]


def test_a_node_that_joins_another_node_s_store_serves_nothing():
    flags = cluster.ClusterFlags(nnodes="2", node_rank=1, master="10.0.0.1:29500")
    choices = plan(cluster=flags).launch
    assert choices.store_bind is None and not choices.agent_joins_held_store and not choices.fresh_worker_store
    assert choices.lost_in_torchrun_line == [] and choices.launcher_env == {}


def test_node_0_of_an_elastic_job_binds_the_endpoint_s_address_for_the_workers_store_too():
    flags = cluster.ClusterFlags(nnodes="1:2", rdzv_endpoint="10.0.0.1:29500", rdzv_id="job")
    choices = plan(cluster=flags).launch
    assert choices.store_bind == "endpoint" and choices.local_worker_store_hook
    assert not plan(cluster=flags, torch_version="2.4.0").launch.local_worker_store_hook


def test_the_json_plan_carries_the_launch_choices():
    data = json.loads(plan().to_json())
    assert data["launch"]["store_bind"] == "127.0.0.1" and data["launch"]["torch_version"] == "2.14.1"
