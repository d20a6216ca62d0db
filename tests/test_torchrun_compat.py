"""torchrun's command line under `ddprun run`: the option table, its parsers, and each row of issue 17's table
that needs no launch (dry runs and refusals). Real launches live in test_torchrun_launch.py."""

from __future__ import annotations

import json

import pytest

from conftest import SCRIPTS, run_ddprun
from ddprun import cluster, report, torchrun_compat
from ddprun.errors import UsageError
from ddprun.plan import Entrypoint, LaunchOptions, build_plan
from ddprun.torchrun_compat import Given

SCRIPT = str(SCRIPTS / "allreduce.py")
SEED = ["--nproc_per_node=2", "--nnodes=1", "--rdzv_id=123", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:29500"]


def plan(**kw):
    defaults = dict(env={}, inventory=[], cpu_count=2, job_id="ddprun-job", log_root="/tmp/x",
                    rdzv_secret="ddprun-secret", torch_version="2.14.1")
    options = kw.pop("options", None) or LaunchOptions(entrypoint=Entrypoint("train.py"), **kw.pop("opts", {}))
    return build_plan(options, **{**defaults, **kw})


# --- the table --------------------------------------------------------------------------------


def test_every_option_of_torchruns_parser_is_in_the_table_in_both_spellings():
    from torch.distributed.run import get_args_parser

    theirs = {s for action in get_args_parser()._actions for s in action.option_strings} - {"-h", "--help"}
    assert theirs <= set(torchrun_compat.ALL_SPELLINGS), theirs - set(torchrun_compat.ALL_SPELLINGS)


def test_every_spelling_in_the_table_is_an_option_of_ddprun_run():
    from typer.main import get_command

    from ddprun.cli import app

    group = get_command(app)
    run = group.commands["run"]
    ours = {name for p in run.params for name in getattr(p, "opts", [])}
    assert set(torchrun_compat.ALL_SPELLINGS) <= ours, set(torchrun_compat.ALL_SPELLINGS) - ours


def test_the_readme_maps_every_torchrun_option_and_variable():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("## From torchrun"):]
    for option in torchrun_compat.OPTIONS:
        assert f"`{option.names[0]}`" in section, option.names[0]
        if option.variable:
            assert option.variable in section, option.variable


# --- parsers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["1_0", "１０", "+3", "2.0", "", " "])
def test_whole_numbers_are_ascii_digits_only(text):
    with pytest.raises(UsageError):
        torchrun_compat.parse_whole(text, label="--nproc", example="2")


def test_a_variable_is_named_as_a_variable():
    with pytest.raises(UsageError, match=r"^DDPRUN_NPROC=x: "):
        torchrun_compat.parse_whole("x", label="DDPRUN_NPROC", example="2")


@pytest.mark.parametrize("text,expected", [("auto", "auto"), ("GPU", "gpu"), ("cpu", "cpu"), ("4", 4)])
def test_nproc_per_node_words(text, expected):
    assert torchrun_compat.parse_nproc(Given(text, "--nproc-per-node")) == expected


def test_rdzv_conf_keys_and_values_are_checked():
    assert torchrun_compat.parse_rdzv_conf(Given("last_call_timeout=5,join_timeout=60", "--rdzv-conf"),
                                           backend="c10d") == {"last_call_timeout": 5, "join_timeout": 60}
    for bad in ("last_call_timout=5", "is_host=0", "join_timeout=-1", "join_timeout=x", "nokey"):
        with pytest.raises(UsageError):
            torchrun_compat.parse_rdzv_conf(Given(bad, "--rdzv-conf"), backend="c10d")


def test_redirects_and_tee_decide_what_the_console_shows():
    assert torchrun_compat.parse_streams(Given("0:1,1:2", "--redirects")) == {0: 1, 1: 2}
    shown = lambda r, t, lr, s: torchrun_compat.stream_shown(redirects=r, tee=t, local_rank=lr, stream=s)  # noqa: E731
    assert not shown(3, None, 0, 1) and not shown(3, None, 1, 2)
    assert shown({0: 1}, None, 0, 2) and not shown({0: 1}, None, 0, 1) and shown({0: 1}, None, 1, 1)
    assert shown(3, 1, 0, 1) and not shown(3, 1, 0, 2)
    with pytest.raises(UsageError):
        torchrun_compat.parse_streams(Given("4", "--redirects"))


def test_prefix_template_macros():
    assert torchrun_compat.check_prefix_template(Given("${hostname}:${rank}: ", "--log-line-prefix-template"))
    with pytest.raises(UsageError, match="ranke"):
        torchrun_compat.check_prefix_template(Given("${ranke} ", "--log-line-prefix-template"))


def test_pet_switch_values_are_0_or_1():
    assert torchrun_compat.switch(Given("1", "PET_NO_PYTHON")) is True
    assert torchrun_compat.switch(Given("0", "PET_NO_PYTHON")) is False
    with pytest.raises(UsageError, match="PET_NO_PYTHON=yes"):
        torchrun_compat.switch(Given("yes", "PET_NO_PYTHON"))


def test_flag_beats_ddprun_variable_beats_pet_variable_beats_default():
    values = {"nproc": "3", "max_restarts": "0"}
    env = {"PET_NPROC_PER_NODE": "4", "PET_MAX_RESTARTS": "2"}
    given = torchrun_compat.given_values(values, sources={"nproc": "flag"}, flags={"nproc": "--nproc"},
                                         envvars={}, env=env)
    assert given["nproc"] == Given("3", "--nproc") and given["max_restarts"] == Given("2", "PET_MAX_RESTARTS")
    given = torchrun_compat.given_values(values, sources={"nproc": "env"}, flags={},
                                         envvars={"nproc": "DDPRUN_NPROC"}, env=env)
    assert given["nproc"] == Given("3", "DDPRUN_NPROC")


def test_unknown_option_suggests_the_closest():
    assert "did you mean --nproc-per-node?" in torchrun_compat.unknown_option(
        "--nproc-per-nod=2", known=["--nproc", "--nproc-per-node", "--gpus"]).message


# --- the plan ---------------------------------------------------------------------------------


def test_seed_command_on_one_node_uses_ddprun_store_on_that_port_and_a_secret_id():
    p = plan(opts=dict(nproc=2, cluster=cluster.ClusterFlags(nnodes="1", rdzv_endpoint="localhost:29500",
                                                             rdzv_id="123")))
    assert p.endpoint == "127.0.0.1:29500" and p.store_role == "host"
    assert p.launch.store_port_fallback and p.launch.fresh_worker_store
    assert p.rdzv_id == "ddprun-secret" and p.user_rdzv_id == "123"
    assert "123" not in p.torchrun_args


def test_master_port_on_one_node_is_the_workers_master_port_not_ddpruns_store():
    options = LaunchOptions(entrypoint=Entrypoint("t.py"), torchrun=torchrun_compat.TorchrunChoices(master_port=29511))
    p = plan(options=options)
    assert p.launch.workers_master == "127.0.0.1:29511"
    assert not p.launch.fresh_worker_store and not p.endpoint.endswith(":29511")
    assert any("29511" in line for line in p.launch.lost_in_torchrun_line)


def test_master_addr_and_port_on_many_nodes_are_static_rendezvous():
    options = LaunchOptions(entrypoint=Entrypoint("t.py"), cluster=cluster.ClusterFlags(nnodes="2", node_rank=1),
                            torchrun=torchrun_compat.TorchrunChoices(master_addr="10.0.0.1", master_port=29400))
    p = plan(options=options)
    assert "--master-addr" in p.torchrun_args and "10.0.0.1" in p.torchrun_args and "29400" in p.torchrun_args


def test_rdzv_conf_is_merged_with_join_timeout():
    options = LaunchOptions(entrypoint=Entrypoint("t.py"),
                            cluster=cluster.ClusterFlags(nnodes="1:2", rdzv_endpoint="10.0.0.1:29400"),
                            torchrun=torchrun_compat.TorchrunChoices(rdzv_conf={"last_call_timeout": 5, "join_timeout": 9}))
    p = plan(options=options)
    assert p.torchrun_args[p.torchrun_args.index("--rdzv-conf") + 1] == "last_call_timeout=5,join_timeout=9"
    assert p.join_timeout_s == 9


def test_a_short_join_timeout_with_the_default_last_call_says_why():
    options = LaunchOptions(entrypoint=Entrypoint("t.py"), join_timeout_s=5,
                            cluster=cluster.ClusterFlags(nnodes="1:2", rdzv_endpoint="10.0.0.1:29400"))
    assert any("last_call_timeout" in n for n in plan(options=options).notices)


@pytest.mark.parametrize("word,expected", [("cpu", 2), ("auto", 2)])
def test_nproc_words_on_a_cpu_machine_are_one_process_per_core(word, expected):
    assert plan(opts=dict(nproc=word), cpu_count=2).nproc_per_node == expected


def test_nproc_gpu_without_a_gpu_is_refused():
    with pytest.raises(UsageError, match="no GPU"):
        plan(opts=dict(nproc="gpu"))


@pytest.mark.parametrize("nproc", [9, 1000000, 10**23])
def test_nproc_has_an_upper_bound(nproc):
    with pytest.raises(UsageError):
        plan(opts=dict(nproc=nproc), cpu_count=2)


def test_force_goes_past_the_per_core_limit_but_not_the_ceiling():
    assert plan(opts=dict(nproc=9, force=True), cpu_count=2).nproc_per_node == 9
    with pytest.raises(UsageError):
        plan(opts=dict(nproc=10**6, force=True), cpu_count=2)


def test_the_console_rank_gets_the_terminal_only_in_a_terminal():
    assert plan(terminal=True).console.tty_rank == 0
    assert plan(terminal=False).console.tty_rank is None
    assert plan(opts=dict(tty_rank=1), terminal=True).console.tty_rank == 1
    with pytest.raises(UsageError, match="--tty-rank 5"):
        plan(opts=dict(tty_rank=5), terminal=True)


def test_prefix_template_from_torchelastic_variable():
    p = plan(env={"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "${local_rank}> "})
    assert p.console.prefix_template == "${local_rank}> "


def test_node_rank_with_c10d_is_refused_not_dropped():
    with pytest.raises(UsageError, match="--node-rank 1"):
        plan(opts=dict(cluster=cluster.ClusterFlags(nnodes="1:2", node_rank=1, rdzv_endpoint="10.0.0.1:29400")))


def test_a_worker_exit_code_2_does_not_read_as_ddpruns_refusal():
    import dataclasses

    fields = {f.name: None for f in dataclasses.fields(report.RankFailure)}

    def code(n):
        return report.exit_code_for(report.RankFailure(**{**fields, "rank": 0, "local_rank": 0, "pid": 1,
                                                           "exitcode": n, "timestamp": 0.0}))

    assert (code(2), code(3), code(1), code(-9)) == (1, 3, 1, 1)


# --- the command line (no launch) -------------------------------------------------------------


def test_seed_flags_are_accepted(cpu_env):
    result = run_ddprun(["run", *SEED, "--dry-run", "--json", SCRIPT], env=cpu_env, timeout=30)
    assert result.returncode == 0, result.stderr
    plan_json = json.loads(result.stdout)
    assert plan_json["nproc_per_node"] == 2 and plan_json["user_rdzv_id"] == "123"
    assert plan_json["endpoint"] == "127.0.0.1:29500"


@pytest.mark.parametrize(
    "args,env,expected",
    [
        (["--bogus"], {}, "unknown option --bogus"),
        (["--nproc_per_nod=2"], {}, "did you mean --nproc_per_node?"),
        (["--nproc", "1_0"], {}, "--nproc 1_0"),
        (["--nproc", "１０"], {}, "expected a whole number"),
        (["--nproc", "99999999999999999999999"], {}, "processes per node"),
        (["--nproc", "1000000"], {}, "processes per node"),
        (["--gpus", "0,1,"], {}, "--gpus 0,1,"),
        (["-m", "no_such_module_17"], {}, "no such module"),
        (["--nproc-per-node", "gpu"], {}, "no GPU is visible"),
        (["--rdzv-conf", "is_host=1"], {}, "is_host"),
        (["--logs-specs", "x"], {}, "--logs-specs"),
        (["--nnodes", "1:2", "--rdzv-endpoint", "localhost:29400", "--node-rank", "1"], {}, "--node-rank 1"),
        ([], {"PET_NO_PYTHON": "yes"}, "PET_NO_PYTHON=yes"),
        ([], {"PET_NPROC_PER_NODE": "x"}, "PET_NPROC_PER_NODE=x"),
        ([], {"DDPRUN_NPROC": "0"}, "DDPRUN_NPROC=0"),
        ([], {"DDPRUN_PORT": "70000"}, "DDPRUN_PORT=70000"),
    ],
)
def test_bad_torchrun_style_input_is_refused_in_one_or_two_lines(args, env, expected, cpu_env):
    result = run_ddprun(["run", *args, "--dry-run", SCRIPT], env=dict(cpu_env, **env), timeout=30)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) <= 2, result.stderr


def test_pet_nproc_per_node_is_read_and_shown_in_the_source_map(cpu_env):
    result = run_ddprun(["run", "--dry-run", "--json", SCRIPT], env=dict(cpu_env, PET_NPROC_PER_NODE="4"), timeout=30)
    assert result.returncode == 0, result.stderr
    plan_json = json.loads(result.stdout)
    assert plan_json["nproc_per_node"] == 4 and plan_json["source"]["nproc"] == "PET_NPROC_PER_NODE"


def test_user_text_is_printed_literally(cpu_env):
    result = run_ddprun(["run", "--dry-run", ":x:[bold]no.py"], env=cpu_env, timeout=30)
    assert result.returncode == 2 and ":x:[bold]no.py: no such script" in result.stderr


def test_sbatch_checks_the_command_every_node_runs(cpu_env):
    for inner, expected in ((["train", "--batch-size", "0"], "--batch-size"), (["run", "--bogus", "x.py"], "--bogus"),
                            (["run", "--nproc", "1_0", "x.py"], "--nproc 1_0")):
        result = run_ddprun(["sbatch", "--", *inner], env=cpu_env, timeout=30)
        assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert run_ddprun(["sbatch", "--", "train", "--epochs", "1"], env=cpu_env, timeout=30).returncode == 0
