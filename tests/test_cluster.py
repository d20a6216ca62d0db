"""Where a job's nodes come from: flags, SLURM, Kubeflow. Pure functions over env mappings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddprun.cluster import (
    DEFAULT_PORT,
    ClusterFlags,
    Endpoint,
    Sourced,
    detect_cluster,
    detect_scheduler,
    expand_hostlist,
    first_host,
    parse_endpoint,
    parse_nnodes,
    parse_port,
)
from ddprun.errors import UsageError


def usage_error(fn, *args, **kwargs) -> str:
    with pytest.raises(UsageError) as info:
        fn(*args, **kwargs)
    assert info.value.exit_code == 2
    return info.value.message


def detect(env=None, **flags):
    return detect_cluster(ClusterFlags(**flags), env or {})


def detect_error(env=None, **flags) -> str:
    message = usage_error(detect_cluster, ClusterFlags(**flags), env or {})
    assert "e.g." in message, message  # every message shows the right form
    return message


# ---------------------------------------------------------------------------------------------
# hostlist


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node1", ["node1"]),
        ("a,b,c", ["a", "b", "c"]),
        ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[001-002]", ["n001", "n002"]),
        ("n[5]", ["n5"]),
        ("n[1,3,5]", ["n1", "n3", "n5"]),
        ("n[1-2,4-5]", ["n1", "n2", "n4", "n5"]),
        ("a[1-2]-ib[3-4]", ["a1-ib3", "a1-ib4", "a2-ib3", "a2-ib4"]),
        ("rack[1-2]n[1-2]", ["rack1n1", "rack1n2", "rack2n1", "rack2n2"]),
        ("node[1-2]-ib", ["node1-ib", "node2-ib"]),
        ("[1-2]", ["1", "2"]),
        ("a[1-2],b[3,4],c", ["a1", "a2", "b3", "b4", "c"]),
        ("gpu-a100-[1-2].cluster.local", ["gpu-a100-1.cluster.local", "gpu-a100-2.cluster.local"]),
        ("  n[1-2]  ", ["n1", "n2"]),
        ("a b", ["a", "b"]),  # SLURM also separates with blanks
        ("a,,b,", ["a", "b"]),
        ("n[1-1]", ["n1"]),
        ("n[3,1]", ["n3", "n1"]),  # SLURM keeps the order it was given
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    "text, why",
    [
        ("a[1-2", "without a matching ']'"),
        ("a1-2]", "without a matching '['"),
        ("a[1-[2]]", "cannot nest"),
        ("a[3-1]", "backwards"),
        ("a[]", "empty brackets"),
        ("a[x-y]", "not a number"),
        ("a[1-]", "not a number"),
        ("a[-1]", "not a number"),
        ("a[1,,2]", "not a number"),
        ("a[1-2-3]", "not a number"),
        ("a[0-70000]", "more than"),
        ("", "no hosts"),
        (" , ", "no hosts"),
    ],
)
def test_expand_hostlist_rejects_bad_syntax(text, why):
    message = usage_error(expand_hostlist, text)
    assert why in message
    assert "e.g. 'gpu[01-04,07],cpu5'" in message


def test_first_host_does_not_expand_the_rest():
    assert first_host("big[00000-65535]x[0-65535]") == "big00000x0"
    assert first_host("b[2-3],a") == "b2"


# ---------------------------------------------------------------------------------------------
# ports, endpoints, nnodes


@pytest.mark.parametrize("text, port", [("29500", 29500), ("1", 1), ("65535", 65535), (" 80 ", 80), (8080, 8080)])
def test_parse_port(text, port):
    assert parse_port(text) == port


@pytest.mark.parametrize("text", ["0", "70000", "65536", "-1", "abc", "", "29500.0", "+80", "²"])
def test_parse_port_rejects(text):
    message = usage_error(parse_port, text)
    assert message == f"--port {text}: a port is 1-65535, e.g. --port 29500"


def test_parse_port_names_the_variable():
    assert usage_error(parse_port, "x", flag="MASTER_PORT") == "MASTER_PORT=x: a port is 1-65535, e.g. MASTER_PORT=29500"


@pytest.mark.parametrize(
    "text, host, port",
    [
        ("node0:29500", "node0", 29500),
        ("10.0.0.1:1234", "10.0.0.1", 1234),
        ("[::1]:29500", "::1", 29500),
        ("[fe80::1%eth0]:29500", "fe80::1%eth0", 29500),
        ("gpu-01.cluster.local:80", "gpu-01.cluster.local", 80),
        ("job-master-0:23456", "job-master-0", 23456),
        ("  node0:29500 ", "node0", 29500),
        ("localhost:65535", "localhost", 65535),
    ],
)
def test_parse_endpoint(text, host, port):
    assert parse_endpoint(text, flag="--master") == Endpoint(host, port)


@pytest.mark.parametrize("text, host", [("node0", "node0"), ("[::1]", "::1"), ("10.0.0.1", "10.0.0.1")])
def test_parse_endpoint_bare_host_takes_the_default_port(text, host):
    assert parse_endpoint(text, flag="--rdzv-endpoint", default_port=29400) == Endpoint(host, 29400)


@pytest.mark.parametrize(
    "text, why, example",
    [
        ("node0", "add the port", "--master node0:29500"),
        ("[::1]", "add the port", "--master [::1]:29500"),
        ("node0:", "1 to 65535", "--master node0:29500"),
        ("node0:0", "1 to 65535", "--master node0:29500"),
        ("node0:70000", "1 to 65535", "--master node0:29500"),
        ("node0:http", "1 to 65535", "--master node0:29500"),
        ("node0:-1", "1 to 65535", "--master node0:29500"),
        (":29500", "host is missing", "--master node0:29500"),
        ("", "host is missing", "--master node0:29500"),
        ("[]:29500", "brackets are only for IPv6", "--master [fd00::1]:29500"),
        ("[node0]:29500", "brackets are only for IPv6", "--master [fd00::1]:29500"),
        ("[::1]29500", "expected [IPV6]:PORT", "--master [fd00::1]:29500"),
        ("[::1:29500", "expected [IPV6]:PORT", "--master [fd00::1]:29500"),
        ("fe80::1:29500", "IPv6 address in brackets", "--master [fd00::1]:29500"),
        ("::1", "IPv6 address in brackets", "--master [fd00::1]:29500"),
        ("[zz::1]:29500", "not a host name or IP address", "--master node0:29500"),
        ("tcp://node0:29500", "without a scheme", "--master node0:29500"),
        ("node 0:29500", "not a host name", "--master node0:29500"),
        ("-node:29500", "not a host name", "--master node0:29500"),
    ],
)
def test_parse_endpoint_rejects(text, why, example):
    message = usage_error(parse_endpoint, text, flag="--master")
    assert message.startswith(f"--master {text.strip()}:")
    assert why in message
    assert example in message


def test_parse_endpoint_error_names_a_variable_like_a_variable():
    message = usage_error(parse_endpoint, "a:b:c:d", flag="PET_RDZV_ENDPOINT")
    assert message.startswith("PET_RDZV_ENDPOINT=a:b:c:d:")
    assert "PET_RDZV_ENDPOINT=[fd00::1]:29500" in message


@pytest.mark.parametrize(
    "endpoint, text",
    [(Endpoint("node0", 29500), "node0:29500"), (Endpoint("::1", 29500), "[::1]:29500"), (Endpoint("10.0.0.1", 1), "10.0.0.1:1")],
)
def test_endpoint_str_round_trips(endpoint, text):
    assert str(endpoint) == text
    assert parse_endpoint(str(endpoint), flag="--master") == endpoint


@pytest.mark.parametrize("text, nodes", [("1", (1, 1)), ("2", (2, 2)), ("1:4", (1, 4)), ("3:3", (3, 3)), (" 2 ", (2, 2))])
def test_parse_nnodes(text, nodes):
    assert parse_nnodes(text) == nodes


@pytest.mark.parametrize(
    "text, why",
    [
        ("0", "at least 1 node"),
        ("0:4", "at least 1 node"),
        ("4:1", "MIN is larger than MAX, e.g. --nnodes 1:4"),
        ("two", "expected a node count"),
        ("", "expected a node count"),
        ("1:", "expected a node count"),
        (":4", "expected a node count"),
        ("1:2:3", "expected a node count"),
        ("-1", "expected a node count"),
        ("1-4", "expected a node count"),
        ("2.0", "expected a node count"),
    ],
)
def test_parse_nnodes_rejects(text, why):
    message = usage_error(parse_nnodes, text)
    assert why in message
    assert "e.g. --nnodes" in message


# ---------------------------------------------------------------------------------------------
# no scheduler: single node and explicit flags


def test_nothing_given_is_a_single_node_job():
    spec = detect()
    assert not spec.is_multi_node()
    assert spec.min_nodes == spec.max_nodes == Sourced(1, "default")
    assert spec.node_rank == Sourced(0, "default")
    assert spec.endpoint is None and spec.rdzv_id is None and spec.gpus_on_node is None
    assert spec.rdzv_backend == "c10d" and spec.scheduler is None
    assert spec.nnodes_text() == "1"


def test_unrelated_environment_is_ignored():
    env = {"MASTER_PORT": "1234", "MASTER_ADDR": "localhost", "SLURM_JOB_ID": "1", "HOME": "/root"}
    assert detect(env) == detect()
    assert detect_scheduler(env) is None


def test_master_gives_static_fixed_membership():
    spec = detect(nnodes="2", node_rank=1, master="node0:29500")
    assert spec.is_multi_node() and not spec.is_elastic()
    assert spec.rdzv_backend == "static"
    assert spec.endpoint == Sourced(Endpoint("node0", 29500), "--master")
    assert spec.node_rank == Sourced(1, "--node-rank")
    assert spec.rdzv_id == Sourced("ddprun-node0-29500", "default")
    assert spec.sources() == {
        "min_nodes": "--nnodes",
        "max_nodes": "--nnodes",
        "node_rank": "--node-rank",
        "endpoint": "--master",
        "rdzv_id": "default",
        "rdzv_backend": "--master",
    }


def test_every_node_derives_the_same_rdzv_id():
    ids = {detect(nnodes="3", node_rank=r, master="10.0.0.1:29500").rdzv_id for r in range(3)}
    assert ids == {Sourced("ddprun-10.0.0.1-29500", "default")}


def test_rdzv_endpoint_gives_c10d():
    spec = detect(nnodes="2", rdzv_endpoint="node0:29400", rdzv_id="exp1")
    assert spec.rdzv_backend == "c10d" and spec.rdzv_backend_source == "--rdzv-endpoint"
    assert spec.endpoint == Sourced(Endpoint("node0", 29400), "--rdzv-endpoint")
    assert spec.rdzv_id == Sourced("exp1", "--rdzv-id")
    assert spec.node_rank == Sourced(0, "default")  # c10d assigns ranks itself


def test_elastic_with_rdzv_endpoint():
    spec = detect(nnodes="1:4", rdzv_endpoint="[fd00::1]:29500")
    assert spec.is_elastic() and spec.is_multi_node()
    assert (spec.min_nodes.value, spec.max_nodes.value) == (1, 4)
    assert spec.nnodes_text() == "1:4"
    assert spec.rdzv_id == Sourced("ddprun-fd00::1-29500", "default")


def test_master_on_a_single_node_is_honoured():
    spec = detect(nnodes="1", master="127.0.0.1:29511")
    assert not spec.is_multi_node()
    assert spec.rdzv_backend == "static"
    assert spec.endpoint == Sourced(Endpoint("127.0.0.1", 29511), "--master")
    assert spec.rdzv_id is None


def test_nnodes_one_with_node_rank_zero_is_consistent():
    spec = detect(nnodes="1", node_rank=0)
    assert spec.node_rank == Sourced(0, "--node-rank") and not spec.is_multi_node()


def test_single_node_rdzv_id_flag_is_kept():
    assert detect(rdzv_id="mine").rdzv_id == Sourced("mine", "--rdzv-id")


def test_as_json_is_plain():
    data = detect(nnodes="2", node_rank=0, master="[::1]:29500").as_json()
    assert data["endpoint"] == "[::1]:29500"
    assert data["nnodes"] == "2" and data["rdzv_backend"] == "static"
    assert data["source"]["endpoint"] == "--master"


@pytest.mark.parametrize(
    "flags, why, example",
    [
        (dict(nnodes="2"), "add --master HOST:PORT", "--nnodes 2 --node-rank 0 --master node0:29500"),
        (dict(nnodes="2", node_rank=1), "add --master HOST:PORT", "--master node0:29500"),
        (dict(master="node0:29500"), "needs their number", "--nnodes 2 --node-rank 0 --master node0:29500"),
        (dict(master="node0:29500", node_rank=0), "needs their number", "--nnodes 2"),
        (dict(nnodes="2", master="node0:29500"), "add --node-rank R", "--nnodes 2 --node-rank 0 --master"),
        (dict(nnodes="1:4", master="node0:29500"), "fixes the set of nodes", "--rdzv-endpoint node0:29500"),
        (dict(nnodes="2:2", master="node0:29500"), "add --node-rank R", "--node-rank 0"),
        (dict(nnodes="1:4"), "add --rdzv-endpoint HOST:PORT", "--nnodes 1:4 --rdzv-endpoint node0:29500"),
        (dict(nnodes="2", node_rank=2, master="n:1"), "out of range for 2 node(s)", "--node-rank 1"),
        (dict(nnodes="1", node_rank=1), "out of range for 1 node(s)", "--node-rank 0"),
        (dict(node_rank=1), "only applies to a multi-node job", "--nnodes 2 --node-rank 1 --master node0:29500"),
        (dict(node_rank=0), "only applies to a multi-node job", "--master node0:29500"),
        (dict(node_rank=-1), "node ranks start at 0", "--node-rank 0"),
        (dict(master="n:1", rdzv_endpoint="n:2"), "both given", "--nnodes 1:4 --rdzv-endpoint node0:29500"),
        (dict(rdzv_id=""), "without blanks", "--rdzv-id exp42"),
        (dict(rdzv_id="a b"), "without blanks", "--rdzv-id exp42"),
        (dict(nnodes="0"), "at least 1 node", "--nnodes 2"),
        (dict(nnodes="2", master="node0"), "add the port", "--master node0:29500"),
        (dict(nnodes="2", rdzv_endpoint="node0:99999"), "1 to 65535", "--rdzv-endpoint node0:29500"),
    ],
)
def test_flag_errors(flags, why, example):
    message = detect_error(**flags)
    assert why in message
    assert example in message


def test_out_of_range_rank_names_both_sources():
    message = detect_error(nnodes="2", node_rank=5, master="n:1")
    assert "node rank 5 (from --node-rank)" in message
    assert "2 node(s) (from --nnodes)" in message


# ---------------------------------------------------------------------------------------------
# SLURM


SLURM_2_NODES = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NODELIST": "gpu[07-08]",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_GPUS_ON_NODE": "4",
}

SLURM_BATCH_2_NODES = {  # the batch script itself: no step variables
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NODELIST": "gpu[07-08]",
    "SLURM_NODEID": "0",
}

SLURM_1_NODE = {
    "SLURM_JOB_ID": "77",
    "SLURM_JOB_NUM_NODES": "1",
    "SLURM_NNODES": "1",
    "SLURM_JOB_NODELIST": "gpu03",
    "SLURM_NODEID": "0",
    "SLURM_STEP_GPUS": "0,1",
}


def test_slurm_multi_node():
    spec = detect(SLURM_2_NODES)
    assert spec.scheduler == "slurm"
    assert spec.is_multi_node() and spec.nnodes_text() == "2"
    assert spec.node_rank == Sourced(1, "SLURM_NODEID")
    assert spec.endpoint == Sourced(Endpoint("gpu07", DEFAULT_PORT), "SLURM_STEP_NODELIST")
    assert spec.rdzv_id == Sourced("4242", "SLURM_JOB_ID")
    assert spec.rdzv_backend == "c10d"
    assert spec.gpus_on_node == Sourced(4, "SLURM_GPUS_ON_NODE")
    assert spec.sources() == {
        "min_nodes": "SLURM_STEP_NUM_NODES",
        "max_nodes": "SLURM_STEP_NUM_NODES",
        "node_rank": "SLURM_NODEID",
        "endpoint": "SLURM_STEP_NODELIST",
        "rdzv_id": "SLURM_JOB_ID",
        "gpus_on_node": "SLURM_GPUS_ON_NODE",
        "rdzv_backend": "default",
    }


def test_slurm_job_variables_without_step_variables():
    env = {k: v for k, v in SLURM_2_NODES.items() if not k.startswith("SLURM_STEP_NU") and k != "SLURM_STEP_NODELIST"}
    spec = detect(env)
    assert spec.max_nodes == Sourced(2, "SLURM_NNODES")
    assert spec.endpoint == Sourced(Endpoint("gpu07", DEFAULT_PORT), "SLURM_JOB_NODELIST")


def test_slurm_falls_back_to_job_num_nodes_and_nodelist():
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_NUM_NODES": "3", "SLURM_NODELIST": "a[1-3]", "SLURM_STEPID": "0",
           "SLURM_NODEID": "2"}
    spec = detect(env)
    assert spec.max_nodes == Sourced(3, "SLURM_JOB_NUM_NODES")
    assert spec.endpoint == Sourced(Endpoint("a1", DEFAULT_PORT), "SLURM_NODELIST")


def test_slurm_step_on_part_of_the_allocation_uses_the_step():
    env = dict(SLURM_2_NODES, SLURM_JOB_NUM_NODES="4", SLURM_JOB_NODELIST="gpu[05-08]")
    spec = detect(env)
    assert spec.max_nodes.value == 2
    assert spec.endpoint.value == Endpoint("gpu07", DEFAULT_PORT)


def test_slurm_master_port():
    spec = detect(dict(SLURM_2_NODES, MASTER_PORT="12345"))
    assert spec.endpoint == Sourced(Endpoint("gpu07", 12345), "SLURM_STEP_NODELIST:MASTER_PORT")


def test_slurm_single_node_is_a_plain_single_node_job():
    spec = detect(SLURM_1_NODE)
    assert spec.scheduler == "slurm"
    assert not spec.is_multi_node()
    assert spec.endpoint is None and spec.rdzv_id is None
    assert spec.max_nodes == Sourced(1, "SLURM_NNODES")
    assert spec.gpus_on_node == Sourced(2, "SLURM_STEP_GPUS")


def test_slurm_batch_script_with_one_node_is_fine():
    spec = detect(dict(SLURM_1_NODE))  # no SLURM_STEP_ID
    assert not spec.is_multi_node()


def test_slurm_detection_needs_a_node_count():
    assert detect_scheduler({"SLURM_JOB_ID": "1"}) is None
    assert detect_scheduler({"SLURM_NNODES": "2"}) is None
    assert detect_scheduler({"SLURM_JOB_ID": "1", "SLURM_NNODES": ""}) is None
    assert detect_scheduler(SLURM_1_NODE) == "slurm"


def test_slurm_wins_over_kubeflow_variables():
    env = dict(SLURM_2_NODES, MASTER_ADDR="elsewhere", WORLD_SIZE="8", RANK="3")
    spec = detect(env)
    assert spec.scheduler == "slurm"
    assert spec.endpoint.value.host == "gpu07"


def test_flags_override_slurm():
    spec = detect(SLURM_2_NODES, rdzv_endpoint="head:29400", rdzv_id="mine")
    assert spec.endpoint == Sourced(Endpoint("head", 29400), "--rdzv-endpoint")
    assert spec.rdzv_id == Sourced("mine", "--rdzv-id")
    assert spec.max_nodes == Sourced(2, "SLURM_STEP_NUM_NODES")
    assert spec.scheduler == "slurm"


def test_master_flag_in_slurm_uses_slurm_nodes_and_rank():
    spec = detect(SLURM_2_NODES, master="gpu07:29600")
    assert spec.rdzv_backend == "static"
    assert spec.node_rank == Sourced(1, "SLURM_NODEID")
    assert spec.max_nodes.source == "SLURM_STEP_NUM_NODES"


def test_nnodes_one_in_a_slurm_step_runs_single_node():
    spec = detect(SLURM_BATCH_2_NODES, nnodes="1")
    assert not spec.is_multi_node() and spec.endpoint is None


def test_node_rank_flag_overrides_slurm_nodeid():
    assert detect(SLURM_2_NODES, node_rank=0).node_rank == Sourced(0, "--node-rank")


def test_slurm_nodeid_out_of_range_for_nnodes_flag():
    message = detect_error(SLURM_2_NODES, nnodes="1")
    assert "node rank 1 (from SLURM_NODEID)" in message and "(from --nnodes)" in message


def test_slurm_batch_script_multi_node_is_refused():
    message = detect_error(SLURM_BATCH_2_NODES)
    assert "not a job step" in message
    assert "srun --ntasks-per-node=1 ddprun" in message


def test_slurm_many_tasks_per_node_is_refused():
    message = detect_error(dict(SLURM_2_NODES, SLURM_STEP_NUM_TASKS="16"))
    assert "SLURM_STEP_NUM_TASKS=16 on 2 nodes" in message
    assert "srun --ntasks-per-node=1" in message


@pytest.mark.parametrize(
    "extra, name",
    [
        ({"SLURM_NNODES": "two", "SLURM_STEP_NUM_NODES": ""}, "SLURM_NNODES=two"),
        ({"SLURM_STEP_NUM_NODES": "0"}, "SLURM_STEP_NUM_NODES=0"),
        ({"SLURM_NODEID": "x"}, "SLURM_NODEID=x"),
        ({"SLURM_GPUS_ON_NODE": "lots"}, "SLURM_GPUS_ON_NODE=lots"),
        ({"SLURM_GPUS_ON_NODE": "", "SLURM_STEP_GPUS": "a,b"}, "SLURM_STEP_GPUS=a,b"),
        ({"SLURM_STEP_NODELIST": "gpu[07-08"}, "SLURM_STEP_NODELIST"),
        ({"MASTER_PORT": "0"}, "MASTER_PORT=0"),
    ],
)
def test_bad_slurm_values_name_the_variable(extra, name):
    message = detect_error(dict(SLURM_2_NODES, **extra))
    assert name in message


def test_slurm_gpu_indices_with_ranges():
    env = dict(SLURM_1_NODE, SLURM_STEP_GPUS="0-3,6")
    assert detect(env).gpus_on_node == Sourced(5, "SLURM_STEP_GPUS")


def test_slurm_without_nodelist_asks_for_an_address():
    env = {k: v for k, v in SLURM_2_NODES.items() if "NODELIST" not in k}
    message = detect_error(env)
    assert "2 nodes (from SLURM_STEP_NUM_NODES)" in message and "--master HOST:PORT" in message


# ---------------------------------------------------------------------------------------------
# Kubeflow PyTorchJob / TrainJob


KUBEFLOW_PLAIN = {  # older training-operator: WORLD_SIZE counts pods
    "MASTER_ADDR": "job-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "3",
    "RANK": "2",
}

KUBEFLOW_PET = {  # newer operator: WORLD_SIZE = pods x processes, PET_NNODES = pods
    "MASTER_ADDR": "job-master-0",
    "MASTER_PORT": "23456",
    "PET_MASTER_ADDR": "job-master-0",
    "PET_MASTER_PORT": "23456",
    "WORLD_SIZE": "16",
    "RANK": "1",
    "PET_NNODES": "2",
    "PET_NODE_RANK": "1",
    "PET_NPROC_PER_NODE": "8",
}

TRAINJOB = {  # Kubeflow Trainer v2: only PET_*
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "8",
    "PET_NODE_RANK": "0",
    "PET_MASTER_ADDR": "trainjob-node-0-0.trainjob",
    "PET_MASTER_PORT": "29400",
}

KUBEFLOW_ELASTIC = {
    "PET_RDZV_ENDPOINT": "job-worker-0:23456",
    "PET_RDZV_BACKEND": "c10d",
    "PET_NNODES": "1:4",
    "PET_RDZV_ID": "job-abc",
}


def test_kubeflow_plain_is_static_with_the_master():
    spec = detect(KUBEFLOW_PLAIN)
    assert spec.scheduler == "kubeflow"
    assert spec.max_nodes == Sourced(3, "WORLD_SIZE")
    assert spec.node_rank == Sourced(2, "RANK")
    assert spec.endpoint == Sourced(Endpoint("job-master-0", 23456), "MASTER_ADDR:MASTER_PORT")
    assert spec.rdzv_backend == "static" and spec.rdzv_backend_source == "default"
    assert spec.rdzv_id == Sourced("ddprun-job-master-0-23456", "default")
    assert spec.gpus_on_node is None


def test_kubeflow_master_port_defaults():
    env = {k: v for k, v in KUBEFLOW_PLAIN.items() if k != "MASTER_PORT"}
    assert detect(env).endpoint == Sourced(Endpoint("job-master-0", DEFAULT_PORT), "MASTER_ADDR")


def test_kubeflow_pet_variables_win():
    spec = detect(KUBEFLOW_PET)
    assert spec.max_nodes == Sourced(2, "PET_NNODES")  # not WORLD_SIZE=16
    assert spec.node_rank == Sourced(1, "PET_NODE_RANK")
    assert spec.endpoint == Sourced(Endpoint("job-master-0", 23456), "PET_MASTER_ADDR:PET_MASTER_PORT")


def test_pet_overrides_plain_when_they_differ():
    env = dict(KUBEFLOW_PLAIN, PET_MASTER_ADDR="other", PET_NODE_RANK="0", PET_NNODES="4")
    spec = detect(env)
    assert spec.endpoint == Sourced(Endpoint("other", 23456), "PET_MASTER_ADDR:MASTER_PORT")
    assert spec.node_rank == Sourced(0, "PET_NODE_RANK")
    assert spec.max_nodes == Sourced(4, "PET_NNODES")


def test_trainjob_with_only_pet_variables():
    spec = detect(TRAINJOB)
    assert spec.scheduler == "kubeflow" and spec.rdzv_backend == "static"
    assert spec.endpoint.value == Endpoint("trainjob-node-0-0.trainjob", 29400)
    assert spec.node_rank == Sourced(0, "PET_NODE_RANK")


def test_kubeflow_elastic_uses_pet_rdzv():
    spec = detect(KUBEFLOW_ELASTIC)
    assert spec.scheduler == "kubeflow" and spec.is_elastic()
    assert spec.rdzv_backend == "c10d" and spec.rdzv_backend_source == "PET_RDZV_BACKEND"
    assert spec.endpoint == Sourced(Endpoint("job-worker-0", 23456), "PET_RDZV_ENDPOINT")
    assert spec.rdzv_id == Sourced("job-abc", "PET_RDZV_ID")
    assert (spec.min_nodes, spec.max_nodes) == (Sourced(1, "PET_NNODES"), Sourced(4, "PET_NNODES"))


def test_kubeflow_rdzv_endpoint_without_port_takes_the_default():
    spec = detect(dict(KUBEFLOW_ELASTIC, PET_RDZV_ENDPOINT="job-worker-0"))
    assert spec.endpoint.value == Endpoint("job-worker-0", DEFAULT_PORT)


def test_kubeflow_etcd_backend_is_refused_unless_a_flag_overrides_it():
    env = dict(KUBEFLOW_ELASTIC, PET_RDZV_BACKEND="etcd-v2")
    message = detect_error(env)
    assert message.startswith("PET_RDZV_BACKEND=etcd-v2: ddprun uses c10d or static rendezvous")
    assert "--rdzv-endpoint node0:29500" in message
    spec = detect(env, rdzv_endpoint="job-worker-0:29400")
    assert spec.rdzv_backend == "c10d" and spec.rdzv_backend_source == "--rdzv-endpoint"


def test_kubeflow_single_pod_is_single_node():
    spec = detect(dict(KUBEFLOW_PLAIN, WORLD_SIZE="1", RANK="0"))
    assert spec.scheduler == "kubeflow" and not spec.is_multi_node()
    assert spec.endpoint is None and spec.rdzv_id is None


def test_kubeflow_needs_all_three_plain_variables():
    for missing in ("MASTER_ADDR", "WORLD_SIZE", "RANK"):
        env = {k: v for k, v in KUBEFLOW_PLAIN.items() if k != missing}
        assert detect_scheduler(env) is None, missing


def test_inside_a_torchrun_worker_is_not_kubeflow():
    env = dict(KUBEFLOW_PLAIN, TORCHELASTIC_RUN_ID="abc", LOCAL_RANK="0")
    assert detect_scheduler(env) is None
    assert not detect(env).is_multi_node()


def test_flags_override_kubeflow():
    spec = detect(KUBEFLOW_PLAIN, nnodes="2", node_rank=1, master="10.1.1.1:29500", rdzv_id="x")
    assert spec.max_nodes == Sourced(2, "--nnodes")
    assert spec.node_rank == Sourced(1, "--node-rank")
    assert spec.endpoint == Sourced(Endpoint("10.1.1.1", 29500), "--master")
    assert spec.rdzv_id == Sourced("x", "--rdzv-id")
    assert spec.scheduler == "kubeflow"


def test_rdzv_endpoint_flag_turns_kubeflow_static_into_c10d():
    spec = detect(KUBEFLOW_PLAIN, rdzv_endpoint="job-master-0:29400")
    assert spec.rdzv_backend == "c10d" and spec.rdzv_backend_source == "--rdzv-endpoint"
    assert spec.max_nodes == Sourced(3, "WORLD_SIZE")


def test_master_flag_with_elastic_pet_nnodes_is_refused():
    message = detect_error(KUBEFLOW_ELASTIC, master="job-worker-0:23456")
    assert "an elastic job of 1:4 nodes (from PET_NNODES) needs c10d" in message
    assert "instead of --master" in message


def test_kubeflow_elastic_without_backend_is_refused():
    env = {k: v for k, v in KUBEFLOW_ELASTIC.items() if k != "PET_RDZV_BACKEND"}
    message = detect_error(env)
    assert "static rendezvous (by default) fixes the set of nodes" in message
    assert "instead of --master" not in message


def test_kubeflow_static_without_a_rank_is_refused():
    env = {k: v for k, v in TRAINJOB.items() if k != "PET_NODE_RANK"}
    message = detect_error(env)
    assert "2 nodes (from PET_NNODES)" in message and "--node-rank" in message


@pytest.mark.parametrize(
    "extra, name",
    [
        ({"WORLD_SIZE": "many"}, "WORLD_SIZE=many"),
        ({"RANK": "-1"}, "RANK=-1"),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT=99999"),
        ({"MASTER_ADDR": "bad host"}, "MASTER_ADDR=bad host"),
        ({"PET_NNODES": "4:1", "PET_MASTER_ADDR": "m"}, "PET_NNODES=4:1"),
        ({"PET_RDZV_BACKEND": "zookeeper"}, "PET_RDZV_BACKEND=zookeeper"),
        ({"RANK": "3"}, "node rank 3 (from RANK)"),
    ],
)
def test_bad_kubeflow_values_name_the_variable(extra, name):
    message = detect_error(dict(KUBEFLOW_PLAIN, **extra))
    assert name in message


# ---------------------------------------------------------------------------------------------
# the module stays light


def test_importing_cluster_does_not_import_torch():
    code = "import sys, ddprun.cluster, ddprun.sbatch; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "False"
