"""Checkpoints: atomic writes that survive kill -9, weights_only loading, RNG round trips, clear errors."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ddprun.worker.checkpoint import (
    FORMAT_VERSION, CheckpointError, capture_rng, load_checkpoint, remove_stale_temps, restore_rng, save_atomic,
)

REPO = Path(__file__).resolve().parents[1]


def minimal_state(**overrides) -> dict:
    state = {
        "format": FORMAT_VERSION, "model": {"weight": torch.ones(3)}, "optimizer": {"state": {}, "param_groups": []},
        "scaler": None, "schedule": {"last_epoch": 10, "base_lrs": [0.1]}, "epoch": 1, "batch_in_epoch": 0,
        "step": 10, "world_size": 1, "rng": [capture_rng()], "best_val_accuracy": None,
        "args": {"model": "mlp", "optimizer": "sgd", "image_size": 8, "lr": None, "resume": False},
    }
    state.update(overrides)
    return state


def test_save_then_load_with_weights_only(tmp_path):
    path = tmp_path / "run" / "last.pt"  # the directory is created
    save_atomic(minimal_state(), str(path))
    loaded = load_checkpoint(str(path))
    assert torch.equal(loaded["model"]["weight"], torch.ones(3)) and loaded["step"] == 10
    assert torch.load(path, weights_only=True)["args"]["model"] == "mlp"
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temp file left


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    save_atomic(minimal_state(step=1), str(path))
    with pytest.raises(Exception):
        save_atomic({"unpicklable": lambda: None}, str(path))
    assert load_checkpoint(str(path))["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]


def test_remove_stale_temps(tmp_path):
    (tmp_path / ".last.pt.abc123.tmp").write_bytes(b"half")
    (tmp_path / "other.tmp").write_bytes(b"keep")
    remove_stale_temps(str(tmp_path / "last.pt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.tmp"]


@pytest.mark.parametrize("content", [b"", b"not a zip", b"PK\x03\x04 truncated zip"])
def test_corrupt_file_names_the_file(tmp_path, content):
    path = tmp_path / "last.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(str(path))
    assert str(path) in str(caught.value) and "corrupt" in str(caught.value)


def test_truncated_checkpoint_is_corrupt(tmp_path):
    path = tmp_path / "last.pt"
    save_atomic(minimal_state(), str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(str(path))


def test_foreign_file_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match="not a ddprun train checkpoint .missing keys: format, model"):
        load_checkpoint(str(path))
    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match="not a ddprun train checkpoint .it holds a list"):
        load_checkpoint(str(path))


def test_unsafe_pickle_is_refused_naming_the_global_and_never_advising_weights_only_false(tmp_path):
    path = tmp_path / "last.pt"
    torch.save(minimal_state(args=Path("/etc")), path)  # an arbitrary object: weights_only refuses it
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(str(path))
    message = str(caught.value)
    assert str(path) in message and "pathlib" in message and "PosixPath" in message, message
    assert "weights_only=False" not in message and "weights_only" not in message.replace("safe load", "")
    assert len(message.splitlines()) == 1


def rng_of_two() -> list:
    return [capture_rng(), capture_rng()]


@pytest.mark.parametrize("overrides, needle", [
    (dict(args="--model mlp"), "args is a str, expected a dict"),
    (dict(world_size=2, rng=[capture_rng()]), "rng holds 1 states for world size 2"),
    (dict(step="10"), "step is a str, expected an int"),
    (dict(step=-1), "step is -1"),
    (dict(epoch=1.5), "epoch is a float, expected an int"),
    (dict(step=True), "step is a bool"),
    (dict(model=[torch.ones(3)]), "model is a list, expected a dict"),
    (dict(model={"weight": [1.0, 2.0]}), "model entry 'weight' is a list, expected a tensor"),
    (dict(optimizer={"state": {}}), "optimizer is not an optimizer state"),
    (dict(schedule={"base_lrs": [0.1]}), "schedule is not an lr scheduler state"),
    (dict(scaler="on"), "scaler is a str, expected a dict or None"),
    (dict(best_val_accuracy="0.9"), "best_val_accuracy is a str"),
    (dict(rng=["seed"]), "rng[0] is a str, expected a dict"),
    (dict(rng=[{"torch": torch.zeros(3)}]), "rng[0].python is missing"),
    (dict(args={"model": "mlp", "optimizer": "sgd", "image_size": "8"}), "args.image_size is a str"),
    (dict(args={"optimizer": "sgd", "image_size": 8}), "args.model is missing"),
    (dict(format=1), "has format 1, expected 2"),
])
def test_wrong_contents_name_the_first_thing_wrong(tmp_path, overrides, needle):
    path = tmp_path / "last.pt"
    save_atomic(minimal_state(**overrides), str(path))
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint(str(path))
    assert needle in str(caught.value) and str(path) in str(caught.value)
    assert len(str(caught.value).splitlines()) == 1


def test_two_rank_checkpoint_with_both_rng_states_loads(tmp_path):
    save_atomic(minimal_state(world_size=2, rng=rng_of_two()), str(tmp_path / "last.pt"))
    assert len(load_checkpoint(str(tmp_path / "last.pt"))["rng"]) == 2


def test_rng_round_trip_through_a_checkpoint(tmp_path):
    import numpy

    random.seed(1), torch.manual_seed(2), numpy.random.seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    save_atomic(minimal_state(rng=[capture_rng()]), str(tmp_path / "last.pt"))
    expected = (random.random(), random.gauss(0, 1), torch.rand(3), numpy.random.rand(2))
    random.seed(9), torch.manual_seed(9), numpy.random.seed(9)
    restore_rng(load_checkpoint(str(tmp_path / "last.pt"))["rng"][0])
    again = (random.random(), random.gauss(0, 1), torch.rand(3), numpy.random.rand(2))
    assert expected[:2] == again[:2]
    assert torch.equal(expected[2], again[2]) and (expected[3] == again[3]).all()


WRITER = textwrap.dedent("""
    import sys, torch
    from ddprun.worker.checkpoint import save_atomic, FORMAT_VERSION
    path = sys.argv[1]
    payload = torch.randn(4_000_000)  # 16 MB: each save spends most of its time writing
    step = 0
    while True:
        step += 1
        save_atomic({"format": FORMAT_VERSION, "model": {"w": payload + step}, "step": step}, path)
        print(step, flush=True)
""")


def test_kill_9_during_save_never_leaves_a_corrupt_file(tmp_path):
    """SIGKILL a process that saves in a loop at random moments; last.pt always loads, newest complete one."""
    path = tmp_path / "last.pt"
    rng = random.Random(0)
    for attempt in range(3):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=REPO, stdout=subprocess.PIPE,
                                  text=True)
        assert writer.stdout.readline().strip()  # at least one save finished
        time.sleep(rng.uniform(0.05, 0.4))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        state = torch.load(path, weights_only=True)
        step = state["step"]
        assert abs(float(state["model"]["w"].mean()) - step) < 0.01  # the payload of that very step
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "last.pt"]
    remove_stale_temps(str(path))
    assert all(name.startswith(".last.pt.") for name in leftovers)
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
