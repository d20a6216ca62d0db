"""TrainOptions: validation of bad input (exit 2 before anything starts) and the argv round trip. No torch."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddprun.errors import UsageError
from ddprun.train_options import (
    MODEL_CHOICES, SaveEvery, TrainOptions, build_parser, class_folders, from_argv, image_folder_roots,
    parse_cli, parse_save_every, to_argv, validate,
)

REPO = Path(__file__).resolve().parents[1]


def make_tree(root: Path, layout: dict[str, int]) -> Path:
    """Create ROOT/<relative class dir>/<n> tiny files; values are file counts."""
    for relative, count in layout.items():
        folder = root / relative
        folder.mkdir(parents=True, exist_ok=True)
        for index in range(count):
            (folder / f"{index}.png").write_bytes(b"")
    return root


def error_of(opts: TrainOptions, **kwargs) -> UsageError:
    with pytest.raises(UsageError) as caught:
        validate(opts, **kwargs)
    assert caught.value.exit_code == 2
    return caught.value


def test_defaults_are_valid_and_match_the_issue():
    opts = TrainOptions()
    validate(opts)
    assert (opts.model, opts.data, opts.optimizer, opts.amp) == ("resnet18", "synthetic", "sgd", "off")
    assert opts.checkpoint_path is None


def test_unknown_model_lists_the_choices():
    error = error_of(TrainOptions(model="resnet9000"))
    assert "resnet9000" in error.message
    for name in ("mlp", "cnn", "resnet18", "resnet50", "vit_b_16"):
        assert name in error.hint


def test_model_choices_hold_small_and_torchvision_models():
    assert MODEL_CHOICES[:2] == ("mlp", "cnn")
    assert len(set(MODEL_CHOICES)) == len(MODEL_CHOICES)
    for name in MODEL_CHOICES:
        size = 224
        validate(TrainOptions(model=name, image_size=size))


@pytest.mark.parametrize("field, value, needle", [
    ("batch_size", 0, "--batch-size 0"),
    ("epochs", 0, "--epochs 0"),
    ("batch_size", -3, "--batch-size -3"),
    ("epochs", -1, "--epochs -1"),
    ("max_steps", 0, "--max-steps 0"),
    ("image_size", 0, "--image-size 0"),
    ("num_classes", 0, "--num-classes 0"),
    ("num_classes", 1, "--num-classes 1"),
    ("dataset_size", 0, "--dataset-size 0"),
    ("grad_accum", 0, "--grad-accum 0"),
    ("save_every", "0", "--save-every 0"),
    ("save_every", "1week", "--save-every 1week"),
    ("save_every", "-2", "--save-every -2"),
    ("warmup_steps", -1, "--warmup-steps -1"),
    ("workers", -1, "--workers -1"),
    ("lr", 0.0, "--lr 0.0"),
    ("lr", -0.1, "--lr -0.1"),
    ("weight_decay", -0.5, "--weight-decay -0.5"),
    ("bucket_cap_mb", 0.0, "--bucket-cap-mb 0.0"),
    ("collective_timeout", -5.0, "--collective-timeout -5.0"),
    ("log_interval", 0.0, "--log-interval 0.0"),
    ("seed", -1, "--seed -1"),
    ("seed", 2**32, "--seed 4294967296"),
])
def test_numbers_out_of_range(field, value, needle):
    error = error_of(TrainOptions(model="mlp", **{field: value}))
    assert needle in error.message


@pytest.mark.parametrize("field, value", [
    ("optimizer", "lamb"), ("amp", "fp8"), ("grad_compression", "int8"), ("grad_allreduce", "nccl"),
])
def test_bad_choices_name_the_alternatives(field, value):
    """(Parametrised above; --lr-schedule below.)"""
    error = error_of(TrainOptions(**{field: value}))
    assert value in error.message and "," in error.message


def test_shm_allreduce_sends_no_compressed_gradients():
    error = error_of(TrainOptions(grad_allreduce="shm", grad_compression="powersgd"))
    assert "--grad-allreduce shm" in error.message and "powersgd" in error.message
    validate(TrainOptions(grad_allreduce="auto", grad_compression="powersgd"))  # auto leaves it to the backend


def test_zero_workers_and_zero_weight_decay_are_fine():
    validate(TrainOptions(workers=0, weight_decay=0.0))


@pytest.mark.parametrize("model, size, hint", [
    ("alexnet", 32, "--image-size 64"),
    ("convnext_tiny", 16, "--image-size 32"),
    ("resnet18", 4, "--image-size 8"),
    ("vit_b_16", 100, "--image-size 96"),
    ("vit_b_32", 16, "--image-size 32"),
])
def test_image_size_too_small_or_not_a_patch_multiple(model, size, hint):
    error = error_of(TrainOptions(model=model, image_size=size))
    assert model in error.message and error.hint.startswith(f"use {hint}")


def test_small_models_take_tiny_images():
    validate(TrainOptions(model="mlp", image_size=4))
    validate(TrainOptions(model="cnn", image_size=4))


def test_missing_data_path(tmp_path):
    error = error_of(TrainOptions(data=str(tmp_path / "nope")))
    assert str(tmp_path / "nope") in error.message and "no such directory" in error.message
    assert "synthetic" in error.hint


def test_data_path_that_is_a_file(tmp_path):
    path = tmp_path / "images.tar"
    path.write_bytes(b"x")
    assert "not a directory" in error_of(TrainOptions(data=str(path))).message


def test_empty_data_directory(tmp_path):
    error = error_of(TrainOptions(data=str(tmp_path)))
    assert "no class folders" in error.message and "train/CLASS" in error.hint


def test_train_without_class_folders(tmp_path):
    make_tree(tmp_path, {"train": 3})  # images directly in train/, no classes
    assert "no class folders" in error_of(TrainOptions(data=str(tmp_path))).message


def test_class_folder_without_images(tmp_path):
    make_tree(tmp_path, {"train/cat": 2, "train/dog": 0})
    (tmp_path / "train/dog/notes.txt").write_text("no images here")
    error = error_of(TrainOptions(data=str(tmp_path)))
    assert str(tmp_path / "train" / "dog") in error.message and ".png" in error.hint


def test_train_and_val_layout(tmp_path):
    make_tree(tmp_path, {"train/cat": 2, "train/dog": 1, "val/cat": 1, "val/dog": 1})
    validate(TrainOptions(data=str(tmp_path)))
    assert image_folder_roots(str(tmp_path)) == (str(tmp_path / "train"), str(tmp_path / "val"))
    assert class_folders(str(tmp_path / "train")) == ["cat", "dog"]


def test_plain_layout_and_nested_images(tmp_path):
    make_tree(tmp_path, {"cat/2024": 1, "dog": 1, ".cache": 0})
    validate(TrainOptions(data=str(tmp_path)))
    assert image_folder_roots(str(tmp_path)) == (str(tmp_path), None)
    assert class_folders(str(tmp_path)) == ["cat", "dog"]


def test_val_classes_must_match_train(tmp_path):
    make_tree(tmp_path, {"train/cat": 1, "train/dog": 1, "val/cat": 1})
    assert "different class folders" in error_of(TrainOptions(data=str(tmp_path))).message


def test_num_classes_must_match_the_tree(tmp_path):
    make_tree(tmp_path, {"train/cat": 1, "train/dog": 1})
    validate(TrainOptions(data=str(tmp_path), num_classes=2))
    error = error_of(TrainOptions(data=str(tmp_path), num_classes=10))
    assert "2 class folders" in error.message and "inferred" in error.hint


def test_resume_needs_a_checkpoint_dir():
    assert "--checkpoint-dir" in error_of(TrainOptions(resume=True)).message


def test_resume_names_the_missing_file(tmp_path):
    error = error_of(TrainOptions(resume=True, checkpoint_dir=str(tmp_path)))
    assert str(tmp_path / "last.pt") in error.message


def test_resume_with_a_checkpoint_file_passes_validation(tmp_path):
    (tmp_path / "last.pt").write_bytes(b"corrupt is the worker's business")
    validate(TrainOptions(resume=True, checkpoint_dir=str(tmp_path)))


def test_checkpoint_dir_that_is_a_file(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("")
    assert f"{path} is a file, not a folder" in error_of(TrainOptions(checkpoint_dir=str(path))).message


def test_metrics_json_needs_an_existing_directory(tmp_path):
    validate(TrainOptions(metrics_json=str(tmp_path / "m.json")))
    assert "does not exist" in error_of(TrainOptions(metrics_json=str(tmp_path / "no" / "m.json"))).message


def test_world_size_check_for_synthetic_data():
    opts = TrainOptions(dataset_size=100, batch_size=32)
    validate(opts, world_size=3)
    error = error_of(opts, world_size=4)
    assert "128 samples" in error.message and "--dataset-size 128" in error.hint and "world size 4" in error.message


ROUND_TRIPS = [
    TrainOptions(),
    TrainOptions(model="mlp", data="fake", image_size=16, num_classes=10, dataset_size=64, epochs=3, max_steps=7,
                 batch_size=4, lr=0.05, optimizer="adamw", weight_decay=0.0, amp="bf16", channels_last=True,
                 compile=True, grad_accum=2, sync_bn=True, workers=0, seed=123, checkpoint_dir="/tmp/ck dir",
                 resume=True, save_every="2epochs", metrics_json="m.json", log_interval=0.5, bucket_cap_mb=100.0,
                 grad_compression="bf16", grad_allreduce="backend", static_graph=True, collective_timeout=30.0,
                 lr_schedule="step", warmup_epochs=0.5, label_smoothing=0.0, clip_grad_norm=1.0, hflip=False),
    TrainOptions(warmup_steps=100, save_every="500", lr_schedule="constant"),
    TrainOptions(data="-weird/path=with=equals", lr=1e-07, checkpoint_dir="--looks-like-a-flag"),
    TrainOptions(lr=0.1 + 0.2, bucket_cap_mb=1 / 3),
]


@pytest.mark.parametrize("opts", ROUND_TRIPS)
def test_argv_round_trip(opts):
    argv = to_argv(opts)
    assert all(isinstance(item, str) for item in argv)
    assert from_argv(argv) == opts


def test_to_argv_writes_only_what_differs_from_the_defaults():
    assert to_argv(TrainOptions()) == []
    assert to_argv(TrainOptions(model="cnn", channels_last=True)) == ["--model=cnn", "--channels-last"]


def test_every_field_has_a_flag():
    flags = {action.dest for action in build_parser()._actions}
    assert {field.name for field in dataclasses.fields(TrainOptions)} <= flags


def test_from_argv_rejects_malformed_values(capsys):
    with pytest.raises(SystemExit) as caught:
        from_argv(["--batch-size", "many"])
    assert caught.value.code == 2


def test_options_module_does_not_import_torch():
    code = ("import sys, ddprun.train_options as t; t.validate(t.TrainOptions()); "
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_bad_lr_schedule_names_the_alternatives():
    error = error_of(TrainOptions(lr_schedule="linear"))
    assert "--lr-schedule 'linear'" in error.message and "cosine, step, constant" in error.message


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("field, value, needle", [
    ("lr", NAN, "--lr nan"), ("lr", INF, "--lr inf"),
    ("weight_decay", NAN, "--weight-decay nan"), ("weight_decay", INF, "--weight-decay inf"),
    ("log_interval", NAN, "--log-interval nan"), ("log_interval", INF, "--log-interval inf"),
    ("bucket_cap_mb", NAN, "--bucket-cap-mb nan"), ("bucket_cap_mb", 1e9, "at most 100000"),
    ("collective_timeout", NAN, "--collective-timeout nan"), ("collective_timeout", INF, "--collective-timeout inf"),
    ("collective_timeout", 1e12, "at most 604800"),
    ("label_smoothing", NAN, "--label-smoothing nan"), ("label_smoothing", 1.0, "below 1"),
    ("label_smoothing", -0.1, "at least 0"),
    ("clip_grad_norm", NAN, "--clip-grad-norm nan"), ("clip_grad_norm", 0.0, "greater than 0"),
    ("warmup_epochs", NAN, "--warmup-epochs nan"), ("warmup_epochs", -1.0, "at least 0"),
])
def test_every_float_must_be_finite_and_in_range(field, value, needle):
    error = error_of(TrainOptions(model="mlp", epochs=5, **{field: value}))
    assert needle in error.message and "finite" in error.message


def test_floats_from_the_command_line_too():
    """What the user types reaches the same checks: `--lr nan` parses as a float, then is refused."""
    for flag in ("--lr", "--log-interval", "--collective-timeout", "--bucket-cap-mb", "--weight-decay"):
        for text in ("nan", "inf", "-inf"):
            with pytest.raises(UsageError, match="finite"):
                validate(parse_cli([f"{flag}={text}"]))


def test_warmup_is_given_once_and_shorter_than_the_run():
    assert "both" in error_of(TrainOptions(warmup_epochs=1.0, warmup_steps=10)).message
    assert "--warmup-epochs 3 is not shorter" in error_of(TrainOptions(epochs=3, warmup_epochs=3.0)).message
    validate(TrainOptions(epochs=3, warmup_epochs=2.5))
    # synthetic data: the run's steps are known before any process starts (2048 / 2 / 32 = 32 a rank)
    error = error_of(TrainOptions(epochs=2, warmup_steps=64), world_size=2)
    assert "--warmup-steps 64 is not shorter than the run (64 steps" in error.message
    validate(TrainOptions(epochs=2, warmup_steps=63), world_size=2)


@pytest.mark.parametrize("text, expected", [
    ("500", SaveEvery(500, "steps")), ("500steps", SaveEvery(500, "steps")), ("1step", SaveEvery(1, "steps")),
    ("1epoch", SaveEvery(1, "epochs")), ("3epochs", SaveEvery(3, "epochs")), ("2 Epochs", SaveEvery(2, "epochs")),
])
def test_save_every_counts_steps_or_epochs(text, expected):
    assert parse_save_every(text) == expected
    assert TrainOptions(save_every=text).save_interval == expected


def test_checkpoint_dir_under_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    error = error_of(TrainOptions(checkpoint_dir=str(tmp_path / "file" / "ck" / "deeper")))
    assert str(tmp_path / "file") + " is a file, not a folder" in error.message


def test_checkpoint_dir_that_does_not_exist_yet_is_fine_and_not_created(tmp_path):
    validate(TrainOptions(checkpoint_dir=str(tmp_path / "new" / "run")))
    assert not (tmp_path / "new").exists()  # --dry-run runs these checks: they create nothing


def test_data_folder_that_cannot_be_read(tmp_path, monkeypatch):
    make_tree(tmp_path, {"train/cat": 1, "train/dog": 1})
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: real_access(path, mode)
                        and not str(path).endswith("dog"))  # root reads anything: pretend it cannot
    error = error_of(TrainOptions(data=str(tmp_path)))
    assert str(tmp_path / "train" / "dog") + " is not readable" in error.message
