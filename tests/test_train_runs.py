"""Real trainer runs on CPU (gloo): equivalence, resume exactness, restarts, learning, metrics, bad input.

Two-process launches go through the installed `ddprun train` (the example script also through
plain torchrun); each costs several seconds, so there are few and their results are shared.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import ddprun_command
from digits import write_digits_tree

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
DDPRUN_TRAIN = ddprun_command() + ["train", "--cpu", "--nproc", "2"]
WORKER = ["-m", "ddprun.worker.train"]

# A model without batch norm (the small cnn drifts further: max-pool and conv sums reorder with the batch),
# enough steps per epoch that a restart lands mid-run.
SYNTHETIC = ["--model", "mlp", "--image-size", "16", "--num-classes", "4", "--dataset-size", "3200",
             "--epochs", "3", "--lr", "0.01", "--seed", "3", "--log-interval", "0.5",
             "--collective-timeout", "60"]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "TORCHELASTIC_RESTART_COUNT", "CUDA_VISIBLE_DEVICES")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    return env


def launch(command: list[str], *, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=timeout)


def two_procs(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return launch(DDPRUN_TRAIN + args, **kwargs)


def one_proc(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return launch([sys.executable] + WORKER + args, **kwargs)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def weights(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint_dir / "last.pt", weights_only=True)["model"]


def make_image_folder(root: Path, *, per_class_train: int = 48, per_class_val: int = 16, size: int = 16) -> Path:
    """A learnable ImageFolder tree: horizontal/vertical stripes in warm/cool colours, random period and noise."""
    rng = np.random.default_rng(0)
    classes = ["horizontal_warm", "horizontal_cool", "vertical_warm", "vertical_cool"]
    coords = np.arange(size)
    for split, count in (("train", per_class_train), ("val", per_class_val)):
        for label, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            # One val image fewer in one class: an odd val set, shards of unequal length.
            for index in range(count - (split == "val" and label == 0)):
                period = int(rng.integers(3, 6))
                stripes = ((coords + rng.integers(0, period)) % period < period / 2).astype(np.float32)
                mask = np.outer(stripes, np.ones(size)) if label < 2 else np.outer(np.ones(size), stripes)
                warm = [rng.uniform(0.6, 1), rng.uniform(0, 0.4), rng.uniform(0, 0.3)]
                cool = [rng.uniform(0, 0.3), rng.uniform(0, 0.4), rng.uniform(0.6, 1)]
                color = np.array(warm if label % 2 == 0 else cool)
                pixels = mask[..., None] * color + rng.normal(0, 0.15, (size, size, 3)) + 0.2
                Image.fromarray((np.clip(pixels, 0, 1) * 255).astype(np.uint8)).save(folder / f"{index}.png")
    return root


@pytest.fixture(scope="module")
def image_tree(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="module")
def two_proc_synthetic(tmp_path_factory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """The uninterrupted 2-process reference run: (checkpoint dir, metrics file, result)."""
    out = tmp_path_factory.mktemp("two_proc")
    result = ok(two_procs(SYNTHETIC + ["--batch-size", "8", "--checkpoint-dir", str(out / "ck"),
                                       "--metrics-json", str(out / "metrics.json")]))
    return out / "ck", out / "metrics.json", result


def test_equivalence_two_procs_at_b_equal_one_proc_at_2b(two_proc_synthetic, tmp_path):
    reference, _, _ = two_proc_synthetic
    ok(one_proc(SYNTHETIC + ["--batch-size", "16", "--checkpoint-dir", str(tmp_path / "ck")]))
    two, one = weights(reference), weights(tmp_path / "ck")
    assert list(two) == list(one) and not any(name.startswith("module.") for name in two)
    initial = torch.load(reference / "last.pt", weights_only=True)
    assert initial["step"] == 600 and initial["epoch"] == 3
    for name in two:
        torch.testing.assert_close(two[name], one[name], rtol=1e-4, atol=1e-5)


def test_gloo_all_reduce_ends_where_the_shared_memory_one_does(two_proc_synthetic, tmp_path):
    """The default on one CPU host sums in shared memory; DDP's own gloo all-reduce must agree with it."""
    reference, metrics_path, _ = two_proc_synthetic
    assert json.loads(metrics_path.read_text())["grad_allreduce"] == "shm"
    ok(two_procs(SYNTHETIC + ["--batch-size", "8", "--epochs", "1", "--grad-allreduce", "backend",
                              "--checkpoint-dir", str(tmp_path / "gloo")]))
    ok(two_procs(SYNTHETIC + ["--batch-size", "8", "--epochs", "1", "--grad-allreduce", "shm", "--bucket-cap-mb",
                              "0.01", "--checkpoint-dir", str(tmp_path / "shm")]))  # many small buckets
    gloo, shm = weights(tmp_path / "gloo"), weights(tmp_path / "shm")
    for name in gloo:
        torch.testing.assert_close(shm[name], gloo[name], rtol=1e-5, atol=1e-6)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("ddprun-")]


def test_metrics_json_and_summary(two_proc_synthetic):
    _, metrics_path, result = two_proc_synthetic
    metrics = json.loads(metrics_path.read_text())
    assert metrics["world_size"] == 2 and metrics["global_batch_size"] == 16
    assert metrics["steps"] == 600 and metrics["epochs"] == 3
    assert metrics["samples_per_sec"] > 0 and metrics["wall_time_s"] > 0
    assert metrics["val_accuracy"] is None and isinstance(metrics["final_loss"], float)
    # Rank 0 alone reports: one announcement, one summary table, on stderr.
    assert result.stderr.count("ddprun train: mlp on synthetic data, 2 process(es)") == 1
    assert result.stderr.count("samples/s (global)") == 1 and "epoch 3/3 done" in result.stderr
    assert "samples/s (global)" not in result.stdout


def worker_pids(parent: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                pids.append(int(entry.name))
    return pids


def test_restarted_workers_resume_from_the_checkpoint(two_proc_synthetic, tmp_path):
    """kill -9 one worker after the first save: ddprun restarts the group, which resumes from last.pt
    and ends with exactly the weights of the uninterrupted run."""
    checkpoint = tmp_path / "ck"
    command = DDPRUN_TRAIN + ["--max-restarts", "1"] + SYNTHETIC + ["--batch-size", "8", "--checkpoint-dir",
                                                                     str(checkpoint)]
    job = subprocess.Popen(command, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        deadline = time.monotonic() + 90
        while not (checkpoint / "last.pt").exists() and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.02)
        victims = worker_pids(job.pid)
        assert victims, "no worker found to kill"
        os.kill(max(victims), signal.SIGKILL)
        _, stderr = job.communicate(timeout=150)
    finally:
        if job.poll() is None:  # a hung job: take its workers down with it
            for pid in worker_pids(job.pid):
                os.kill(pid, signal.SIGKILL)
            job.kill()
            job.wait()
    assert job.returncode == 0, stderr[-3000:]
    assert "resuming from" in stderr and "(restart 1)" in stderr
    assert not [name for name in os.listdir("/dev/shm") if name.startswith("ddprun-")]  # none left by kill -9
    reference = weights(two_proc_synthetic[0])
    restarted = weights(checkpoint)
    for name in reference:
        assert torch.equal(reference[name], restarted[name]), name


IMAGES = ["--model", "cnn", "--image-size", "16", "--batch-size", "16", "--workers", "0", "--optimizer", "adamw",
          "--lr", "0.003", "--log-interval", "0.5"]


def test_it_learns_on_an_image_folder_with_val_reduced_over_ranks(image_tree, tmp_path):
    metrics_path = tmp_path / "metrics.json"
    result = ok(two_procs(IMAGES + ["--data", str(image_tree), "--epochs", "5",
                                    "--metrics-json", str(metrics_path)]))
    metrics = json.loads(metrics_path.read_text())
    assert metrics["val_samples"] == 63  # each val image counted once over both ranks, none padded
    assert metrics["val_accuracy"] >= 0.8, result.stderr  # chance is 0.25
    assert "val accuracy" in result.stderr


def test_kill_after_epoch_2_of_4_then_resume_equals_uninterrupted(image_tree, tmp_path):
    """SIGKILL once epoch 2's checkpoint is written; --resume ends with the uninterrupted run's weights.
    Random flips draw from the RNG and the lr follows warmup + cosine, so exact equality also shows that
    the RNG states and the schedule's state came back."""
    base = IMAGES + ["--data", str(image_tree), "--workers", "1", "--epochs", "4"]  # worker seeds: RNG too
    ok(one_proc(base + ["--checkpoint-dir", str(tmp_path / "straight")]))
    killed = tmp_path / "killed"
    job = subprocess.Popen([sys.executable] + WORKER + base + ["--checkpoint-dir", str(killed)], cwd=REPO,
                           env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while job.poll() is None and time.monotonic() < deadline and not saved_epoch_at_least(killed, 2):
            time.sleep(0.01)
        job.kill()
    finally:
        job.wait()
    stopped_at = torch.load(killed / "last.pt", weights_only=True)["epoch"]
    assert 2 <= stopped_at < 4, "the run ended before it was killed: make its epochs longer"
    resumed = ok(one_proc(base + ["--checkpoint-dir", str(killed), "--resume"]))
    assert f"last.pt after epoch {stopped_at}, step" in resumed.stderr and "epoch 4/4 done" in resumed.stderr
    straight, again = weights(tmp_path / "straight"), weights(killed)
    for name in straight:
        assert torch.equal(straight[name], again[name]), name
    state = torch.load(killed / "last.pt", weights_only=True)
    reference = torch.load(tmp_path / "straight" / "last.pt", weights_only=True)
    assert state["schedule"] == reference["schedule"] and state["schedule"]["last_epoch"] == state["step"]
    assert state["epoch"] == 4 and set(state["rng"][0]) >= {"torch", "python"}


def saved_epoch_at_least(directory: Path, epoch: int) -> bool:
    try:
        return torch.load(directory / "last.pt", weights_only=True)["epoch"] >= epoch
    except (FileNotFoundError, RuntimeError, EOFError):
        return False


@pytest.fixture(scope="module")
def digits_tree(tmp_path_factory) -> Path:
    pytest.importorskip("sklearn", reason="the digits set ships with scikit-learn: pip install -e '.[test]'")
    return write_digits_tree(tmp_path_factory.mktemp("digits"))


def test_defaults_learn_a_real_image_set_to_95_percent(digits_tree, tmp_path):
    """scikit-learn's handwritten digits (1442 train, 355 val, 10 classes, 16x16), 2 processes, the default
    recipe for 8 epochs. --no-hflip is what this data set needs: a mirrored digit is another glyph."""
    metrics_path = tmp_path / "metrics.json"
    result = ok(two_procs(["--data", str(digits_tree), "--model", "cnn", "--image-size", "16", "--epochs", "8",
                           "--no-hflip", "--checkpoint-dir", str(tmp_path / "ck"),
                           "--metrics-json", str(metrics_path)]))
    metrics = json.loads(metrics_path.read_text())
    curve = [epoch["val_accuracy"] for epoch in metrics["history"]]
    assert metrics["val_samples"] == 355 and len(curve) == 8
    assert metrics["val_accuracy"] >= 0.95, (curve, result.stderr[-2000:])
    assert metrics["history"][-1]["lr"] == 0.0 and metrics["history"][0]["lr"] > metrics["history"][3]["lr"]
    best = torch.load(tmp_path / "ck" / "best.pt", weights_only=True)
    assert best["best_val_accuracy"] == max(curve) == metrics["best_val_accuracy"]
    assert best["epoch"] == 1 + curve.index(max(curve))  # the first epoch that reached it


def test_resume_from_a_corrupt_checkpoint_exits_2_naming_the_file(tmp_path):
    (tmp_path / "last.pt").write_bytes(b"PK\x03\x04 half a zip")
    result = one_proc(["--model", "mlp", "--image-size", "8", "--checkpoint-dir", str(tmp_path), "--resume"])
    assert result.returncode == 2
    assert str(tmp_path / "last.pt") in result.stderr and "corrupt" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_input_exits_2_in_the_worker_too(tmp_path):
    result = one_proc(["--model", "resnet9000"])
    assert result.returncode == 2 and "unknown model 'resnet9000'" in result.stderr and "mlp, cnn" in result.stderr


@pytest.mark.parametrize("launcher", [ddprun_command() + ["run", "--cpu", "--nproc", "2"], TORCHRUN],
                         ids=["ddprun", "torchrun"])
def test_example_script_runs_unchanged_under_ddprun_and_torchrun(launcher):
    result = ok(launch(launcher + ["examples/train.py", "--epochs", "2", "--samples", "128"]))
    assert result.stdout.count("epoch 2/2: loss") == 1  # rank 0 alone prints
    assert "over 128 samples" in result.stdout
