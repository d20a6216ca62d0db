"""benchmarks/gpu_check.py: its pure parts, and its dry run on a machine without a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddprun.devices import Gpu, parse_inventory_csv
from gpu_stub import FOUR_GPUS, install_stub_nvidia_smi, path_with

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gc  # dataclasses look their module up while the file runs
_spec.loader.exec_module(gc)

INVENTORY = [Gpu(index=i, uuid=u, name=n, memory_mib=m) for i, u, n, m in FOUR_GPUS]
H200_SMI = "0, GPU-5d1e0a4c-9f3b-4c1a-8e2d-7b6a5c4d3e2f, NVIDIA H200, 143771\n"


# --- inventory: NVML against nvidia-smi ------------------------------------------------


def test_same_inventory_from_both_sides(tmp_path):
    stub = install_stub_nvidia_smi(tmp_path, FOUR_GPUS)
    text = subprocess.run([str(stub), "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, check=True).stdout
    assert gc.compare_inventories(INVENTORY, parse_inventory_csv(text)) == []


def test_one_mib_of_rounding_is_tolerated():
    smi = parse_inventory_csv(H200_SMI)
    nvml = [Gpu(index=0, uuid=smi[0].uuid, name="NVIDIA H200", memory_mib=143770)]
    assert gc.compare_inventories(nvml, smi) == []


def test_every_difference_is_named():
    smi = parse_inventory_csv(H200_SMI)
    nvml = [Gpu(index=1, uuid="GPU-00000000-0000-0000-0000-000000000000", name="NVIDIA H100", memory_mib=81559),
            INVENTORY[0]]
    problems = gc.compare_inventories(nvml, smi)
    assert problems[0] == "NVML lists 2 GPUs, nvidia-smi 1"
    assert [p.split(":")[1].split()[0] for p in problems[1:]] == ["index", "uuid", "name", "memory"]


def test_uuid_prefix_is_accepted_by_the_launcher():
    from ddprun.devices import visible_gpus

    prefix = gc.uuid_prefix(INVENTORY[1].uuid)
    assert prefix == "GPU-1b7e9d20"
    assert visible_gpus(prefix, INVENTORY)[0].gpu == INVENTORY[1]


# --- judging what ran -----------------------------------------------------------------


def test_judge_visible():
    seen = {"uuid": INVENTORY[0].uuid, "cuda_visible_devices": "0"}
    assert gc.judge_visible(seen, expected_uuid=INVENTORY[0].uuid, expected_cvd="0") == []
    wrong = gc.judge_visible(seen, expected_uuid=INVENTORY[1].uuid, expected_cvd="GPU-1b7e9d20")
    assert len(wrong) == 2 and "GPU-1b7e9d20" in wrong[0] and INVENTORY[1].uuid in wrong[1]
    assert gc.judge_visible(None, expected_uuid=None, expected_cvd="0") == ["the rank wrote no record"]


def doctor_report(**statuses):
    checks = [{"name": "NVIDIA driver", "status": "ok", "detail": "driver 580.159.03, 1 GPU", "hint": None},
              {"name": "cuda:0", "status": "ok", "detail": "GPU 0 (NVIDIA H200)", "hint": None},
              {"name": "torch sees the GPUs", "status": "ok", "detail": "1 of 1", "hint": None},
              {"name": "GPU peer-to-peer", "status": "skip", "detail": "fewer than 2 visible GPUs", "hint": None},
              {"name": "port 29500", "status": "ok", "detail": "free", "hint": None},
              {"name": "smoke test", "status": "ok", "detail": "1 ranks on nccl: cuda, every check passed", "hint": None}]
    for check in checks:
        check.update(statuses.get(check["name"], {}))
    bandwidth = [{"bytes": 8, "time_us": 10.0, "algbw_gbps": 0.001, "busbw_gbps": 0.0},
                 {"bytes": 1 << 30, "time_us": 2000.0, "algbw_gbps": 536.9, "busbw_gbps": 0.0}]
    return {"checks": checks, "bandwidth": bandwidth}


def test_judge_doctor_passes_a_healthy_gpu_machine():
    problems, figures = gc.judge_doctor(doctor_report(), gpu=True)
    assert problems == []
    assert figures["peak_algbw_gbps"] == 536.9 and figures["peak_at_bytes"] == 1 << 30
    assert figures["statuses"]["GPU peer-to-peer"] == "skip" and "port 29500" not in figures["statuses"]


def test_judge_doctor_wants_explanations_and_a_passing_smoke_test():
    report = doctor_report(**{"port 29500": {"status": "warn", "detail": "in use by pid 9"},
                              "smoke test": {"status": "fail", "hint": "check NCCL"}})
    problems, _ = gc.judge_doctor(report, gpu=True)
    assert "port 29500: warn without a hint (in use by pid 9)" in problems
    assert any(p.startswith("smoke test: fail") for p in problems)
    assert gc.judge_doctor({"checks": [], "bandwidth": []}, gpu=True)[0][-1] == "no bandwidth rows"


PANEL = """\
[rank 0] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 TiB.
╭─ ddprun: job failed ─────────────────────────────────────────────╮
│ Rank 0 failed: OutOfMemoryError: CUDA out of memory. Tried to    │
│ allocate 4.00 TiB. GPU 0 has a total capacity of 139.81 GiB      │
│   at /repo/benchmarks/gpu_scripts/oom.py:6 in <module>           │
│ hint: The GPU ran out of memory: lower the batch size per GPU,   │
│ or use mixed precision or gradient accumulation.                 │
╰──────────────────────────────────────────────────────────────────╯
"""


def test_panel_text_joins_the_wrapped_panel():
    text = gc.panel_text(PANEL)
    assert text.startswith("ddprun: job failed Rank 0 failed: OutOfMemoryError")
    assert "The GPU ran out of memory: lower the batch size per GPU, or use" in text
    assert gc.panel_text("no panel here") == ""


def test_judge_oom():
    assert gc.judge_oom(PANEL, gpu=True, script="oom.py") == []
    without_hint = PANEL.replace("The GPU ran out of memory", "Something else")
    assert gc.judge_oom(without_hint, gpu=True, script="oom.py") == ["the panel has no hint with 'ran out of memory'"]
    assert gc.judge_oom("Traceback ...", gpu=True, script="oom.py") == ["no failure panel on stderr"]


def test_parse_nvidia_smi_process_and_memory_queries():
    assert gc.parse_compute_apps("4242, 4608\n4243, [N/A]\n") == [(4242, 4608), (4243, 0)]
    assert gc.parse_compute_apps("") == []
    assert gc.parse_memory_used("1 \n") == 1
    assert gc.parse_memory_used("[N/A]\n") is None and gc.parse_memory_used("") is None


def test_judge_speed():
    assert gc.judge_speed(2900.0, 3000.0) == ([], {"ddprun_images_per_s": 2900.0, "plain_images_per_s": 3000.0,
                                                  "ratio": 0.967})
    problems, figures = gc.judge_speed(2000.0, 3000.0)
    assert problems == ["ddprun train reaches 67% of the plain loop (< 90%)"] and figures["ratio"] == 0.667
    assert gc.judge_speed(None, 3000.0)[0] == ["no images/s from ddprun train"]


# --- summarising ------------------------------------------------------------------------


def test_summarize_counts_and_lists_every_step():
    results = [gc.StepResult("inventory", gc.PASS, "agree", 0.5, {"driver_version": "580.159.03"}),
               gc.StepResult("train", gc.FAIL, "slow", 61.0, {"ratio": 0.5, "bandwidth": [1, 2]}),
               gc.StepResult("kill9", gc.SKIP, "no GPU")]
    document, text = gc.summarize(results, context={"mode": "gpu"})
    assert document["counts"] == {"pass": 1, "fail": 1, "skip": 1}
    assert [s["name"] for s in document["steps"]] == ["inventory", "train", "kill9"]
    assert json.loads(json.dumps(document)) == document
    lines = text.splitlines()
    assert lines[0] == "ddprun GPU check: 1 passed, 1 failed, 1 skipped"
    assert "FAIL  train" in text and "ratio: 0.5" in text and "bandwidth" not in text


def test_a_step_that_raises_is_a_failure_not_the_end(tmp_path):
    def broken(ctx):
        raise KeyError("samples_per_sec")

    ctx = gc.Context(out=tmp_path, target=gc.GPU_TARGET, inventory=[], smi_present=False, deadline=float("inf"))
    result = gc.run_step("train", broken, ctx)
    assert (result.status, result.reason) == (gc.FAIL, "KeyError: 'samples_per_sec'")
    ctx.deadline = 0.0
    assert gc.run_step("train", broken, ctx).status == gc.SKIP


def test_no_gpu_reason():
    assert gc.no_gpu_reason(INVENTORY, smi_present=True) is None
    assert "dry run" in gc.no_gpu_reason([], smi_present=False)
    assert "nvidia-smi is present" in gc.no_gpu_reason([], smi_present=True)


# --- the dry run, end to end --------------------------------------------------------------


@pytest.fixture
def no_gpu_path(tmp_path):
    """A PATH without nvidia-smi, whatever this machine has (NVML may still find a GPU: then skip)."""
    from ddprun import devices

    if devices.read_inventory():
        pytest.skip("this machine has a GPU: the dry run does not apply")
    bare = [p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "nvidia-smi").exists()]
    return os.pathsep.join(bare)


def test_dry_run_skips_the_gpu_steps_and_says_why(tmp_path, no_gpu_path):
    out = tmp_path / "out"
    env = {**os.environ, "PATH": no_gpu_path}
    env.pop("OUT", None)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    document = json.loads((out / "gpu_check.json").read_text())
    statuses = {step["name"]: (step["status"], step["reason"]) for step in document["steps"]}
    assert statuses["scripts"][0] == "pass"
    assert statuses["inventory"] == ("skip", "no NVIDIA driver: NVML does not load and nvidia-smi is absent")
    for name in ("visible", "doctor", "oom", "kill9", "train", "compile"):
        assert statuses[name][0] == "skip" and "dry run" in statuses[name][1]
    assert (out / "gpu_check.txt").read_text() == done.stdout


def test_a_stub_gpu_machine_compares_the_inventory_with_nvidia_smi(tmp_path, monkeypatch):
    """nvidia-smi answers (the stub) but NVML does not: the inventory step must fail, not pass on smi alone."""
    from ddprun import devices

    if devices._read_nvml_inventory() is not None:
        pytest.skip("NVML answers on this machine")
    stub = install_stub_nvidia_smi(tmp_path / "bin", FOUR_GPUS)
    monkeypatch.setenv("PATH", path_with(stub.parent))
    status, reason, figures = gc.step_inventory(None)
    assert (status, reason) == (gc.FAIL, "nvidia-smi answers but NVML (pynvml) does not")
    assert FOUR_GPUS[0][1] in figures["nvidia_smi"]


def test_the_shell_entry_makes_its_venv_and_runs_the_dry_run(tmp_path, no_gpu_path):
    out = tmp_path / "out"
    python_dir = str(Path(sys.executable).parent)  # its python3 is the one whose packages the venv sees
    env = {**os.environ, "PATH": os.pathsep.join([python_dir, no_gpu_path]), "GPU_CHECK_VENV": str(tmp_path / "venv")}
    env.pop("OUT", None)
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"gpu_check: python {tmp_path / 'venv' / 'bin' / 'python'}" in done.stderr, (out / "setup.log").read_text()
    assert done.stdout.startswith("ddprun GPU check: 1 passed, 0 failed, 7 skipped")
    assert json.loads((out / "gpu_check.json").read_text())["context"]["mode"] == "dry (no GPU)"
