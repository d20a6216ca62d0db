"""Rank 0's reporting: plain lines off a terminal, a Rich bar on one, the summary table, metrics JSON."""

from __future__ import annotations

import io
import json

from rich.console import Console

from ddprun.worker.progress import NullReporter, Reporter, RunSummary, summary_table, write_metrics


def summary(**overrides) -> RunSummary:
    values = dict(
        world_size=2, global_batch_size=64, batch_size_per_process=32, steps=120, epochs=3,
        samples_per_sec=1234.5, samples_per_sec_per_process=617.25, cpu_seconds_per_step=0.1, wall_time_s=12.5, final_loss=0.4321,
        val_accuracy=0.875, val_samples=63, peak_memory_bytes=512 * 2**20, peak_memory_kind="rss",
        model="resnet18", device="cpu", grad_allreduce="shm", resumed_from_step=None,
    )
    values.update(overrides)
    return RunSummary(**values)


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_off_a_terminal():
    stream = io.StringIO()
    reporter = Reporter(total_steps=4, start_step=0, epochs=2, global_batch=64, log_interval=0.0, stream=stream)
    reporter.start_epoch(0)
    reporter.step(1, lambda: 2.5)
    reporter.end_epoch(0, loss=2.25, val_accuracy=0.5)
    reporter.start_epoch(1)
    reporter.step(3, lambda: 1.5)
    reporter.end_epoch(1, loss=1.0, val_accuracy=None, stopped_at=3)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("epoch 1/2 step 1/4 loss 2.5000 ") and "samples/s eta 0:00:" in lines[0]
    assert lines[1] == "epoch 1/2 done, loss 2.2500, val accuracy 50.00%"
    assert lines[2].startswith("epoch 2/2 step 3/4 loss 1.5000")
    assert lines[3] == "epoch 2/2 stopped at step 3 (--max-steps), loss 1.0000"
    assert "\x1b[" not in stream.getvalue()  # no terminal codes in logs


def test_plain_lines_respect_the_interval_and_read_the_loss_only_when_shown():
    stream = io.StringIO()
    reads = []
    reporter = Reporter(total_steps=100, start_step=0, epochs=1, global_batch=8, log_interval=3600, stream=stream)
    reporter.start_epoch(0)
    for step in range(1, 50):
        reporter.step(step, lambda: reads.append(1) or 1.0)
    assert stream.getvalue() == "" and reads == []  # no device sync for a line nobody sees


def test_rich_bar_in_a_terminal():
    stream = FakeTerminal()
    reporter = Reporter(total_steps=10, start_step=0, epochs=2, global_batch=64, log_interval=10, stream=stream)
    reporter.start_epoch(0)
    reporter._last_shown = 0.0  # let the next step refresh loss and speed
    reporter.step(5, lambda: 0.75)
    reporter.note("epoch 1/2 done, loss 0.7500")
    reporter.summary(summary())
    text = stream.getvalue()
    assert "epoch 1/2" in text and "step 5/10" in text and "loss 0.7500" in text and "samples/s" in text
    assert "ddprun train: resnet18 on 2 x cpu" in text


def render(table) -> str:
    console = Console(file=io.StringIO(), width=120)
    console.print(table)
    return console.file.getvalue()


def test_summary_table_rows():
    text = render(summary_table(summary()))
    for expected in ("epochs", "3", "steps", "120", "global batch", "64 (2 x 32)", "samples/s (global)", "1,234.5",
                     "samples/s (per process)", "617.2", "wall time", "12.5 s", "final loss", "0.4321",
                     "val accuracy", "87.50%", "resident memory", "512 MiB"):
        assert expected in text, expected


def test_summary_table_without_val_and_on_gpu_with_accumulation():
    text = render(summary_table(summary(val_accuracy=None, peak_memory_kind="cuda", global_batch_size=128,
                                        resumed_from_step=40)))
    assert "no val set" in text and "GPU memory" in text and "x accumulation" in text
    assert "resumed from step" in text and "40" in text


def test_metrics_json_keys(tmp_path):
    path = tmp_path / "metrics.json"
    write_metrics(summary(val_accuracy=None), str(path))
    metrics = json.loads(path.read_text())
    for key in ("world_size", "global_batch_size", "steps", "epochs", "samples_per_sec", "final_loss",
                "val_accuracy", "wall_time_s"):
        assert key in metrics, key
    assert metrics["val_accuracy"] is None and metrics["world_size"] == 2


def test_null_reporter_is_silent(capsys):
    reporter = NullReporter()
    reporter.start_epoch(0)
    reporter.step(1, lambda: 1 / 0)  # never reads the loss
    reporter.end_epoch(0, loss=1.0, val_accuracy=None)
    reporter.note("hello")
    reporter.summary(summary())
    reporter.close()
    assert capsys.readouterr() == ("", "")


def test_the_launcher_draws_the_trainers_bar_in_a_terminal(cpu_env):
    """A real `ddprun train` on a pseudo-terminal: rank 0 feeds the launcher, which draws the bar
    from the first record on; rank 0's summary reaches the terminal too."""
    from conftest import run_ddprun_on_a_terminal

    args = ["train", "--cpu", "--nproc", "2", "--model", "mlp", "--image-size", "8", "--batch-size", "8",
            "--dataset-size", "100000", "--max-steps", "3000"]
    code, text = run_ddprun_on_a_terminal(args, env=dict(cpu_env, OMP_NUM_THREADS="1"))
    assert code == 0, text[-3000:]
    assert "/3000" in text and "\x1b[2K" in text  # the bar's "step N/3000", redrawn in place
    assert "samples/s (global)" in text
