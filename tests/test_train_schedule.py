"""The recipe's pure parts: default lr (linear rule), weight decay, warmup length, lr schedules."""

from __future__ import annotations

import pytest
import torch

from ddprun.train_options import TrainOptions
from ddprun.worker import schedule
from ddprun.worker.schedule import lr_factor, warmup_steps


def test_sgd_lr_follows_the_linear_rule_and_adamw_keeps_its_own():
    assert schedule.learning_rate(TrainOptions(), global_batch=256) == pytest.approx(0.1)
    assert schedule.learning_rate(TrainOptions(), global_batch=64) == pytest.approx(0.025)
    assert schedule.learning_rate(TrainOptions(optimizer="adamw"), global_batch=4096) == 1e-3
    assert schedule.learning_rate(TrainOptions(lr=0.3), global_batch=64) == 0.3  # given: used as is
    assert schedule.weight_decay(TrainOptions()) == 1e-4
    assert schedule.weight_decay(TrainOptions(optimizer="adamw")) == 0.05
    assert schedule.weight_decay(TrainOptions(weight_decay=0.0)) == 0.0


def test_warmup_length():
    assert warmup_steps(TrainOptions(), per_epoch=22, horizon=176) == 18  # auto: 10% of the run, at most an epoch
    assert warmup_steps(TrainOptions(), per_epoch=10, horizon=900) == 10
    assert warmup_steps(TrainOptions(warmup_epochs=0.5), per_epoch=22, horizon=176) == 11
    assert warmup_steps(TrainOptions(warmup_epochs=0.0), per_epoch=22, horizon=176) == 0
    assert warmup_steps(TrainOptions(warmup_steps=7), per_epoch=22, horizon=176) == 7


def test_cosine_rises_linearly_then_falls_to_zero():
    factors = [lr_factor(step, kind="cosine", warmup=4, horizon=20) for step in range(21)]
    assert factors[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert factors[4:] == sorted(factors[4:], reverse=True) and factors[12] == pytest.approx(0.5)
    assert factors[20] == pytest.approx(0.0)


def test_step_and_constant():
    steps = [lr_factor(step, kind="step", warmup=0, horizon=30) for step in (0, 9, 10, 19, 20, 29, 35)]
    assert steps == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01, 0.01])
    assert [lr_factor(step, kind="constant", warmup=2, horizon=9) for step in range(5)] == \
        pytest.approx([1 / 3, 2 / 3, 1, 1, 1])


def test_scheduler_state_continues_exactly():
    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)

    first = optimizer()
    straight = schedule.build_scheduler(first, kind="cosine", warmup=3, horizon=12)
    for _ in range(5):
        first.step(), straight.step()
    state = straight.state_dict()
    second = optimizer()
    second.load_state_dict(first.state_dict())
    resumed = schedule.build_scheduler(second, kind="cosine", warmup=3, horizon=12, state=state)
    for _ in range(4):
        first.step(), straight.step(), second.step(), resumed.step()
        assert straight.get_last_lr() == resumed.get_last_lr()
