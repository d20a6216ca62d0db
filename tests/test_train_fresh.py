"""The trainer's launch tests that matter most, again with a fresh Python process per rank
(--fresh-start, through DDPRUN_WARM_START=0): warm start is the trainer's default, and both
modes must train, restart, resume and refuse bad input alike."""

from __future__ import annotations

import pytest

from test_train_runs import (  # noqa: F401  (collected again here, with fresh ranks)
    image_tree,
    test_bad_input_exits_2_in_the_worker_too,
    test_it_learns_on_an_image_folder_with_val_reduced_over_ranks,
    test_kill_after_epoch_2_of_4_then_resume_equals_uninterrupted,
    test_restarted_workers_resume_from_the_checkpoint,
    two_proc_synthetic,
)
from test_train_prestart import test_every_rank_reports_a_bad_checkpoint  # noqa: F401


@pytest.fixture(scope="module", autouse=True)
def fresh_start():
    """The launches above take their environment from this process's."""
    patch = pytest.MonkeyPatch()
    patch.setenv("DDPRUN_WARM_START", "0")
    yield
    patch.undo()


@pytest.fixture
def cpu_env(cpu_env):
    return dict(cpu_env, DDPRUN_WARM_START="0")


def test_these_launches_are_fresh(cpu_env):
    import json

    from conftest import run_ddprun
    from test_train_runs import clean_env

    for env in (cpu_env, clean_env()):
        result = run_ddprun(["train", "--cpu", "--dry-run", "--json"], env=env)
        assert json.loads(result.stdout)["launch"]["warm_start"] is False, result.stderr
