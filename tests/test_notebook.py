"""ddprun.launch in Jupyter: a real notebook run in a real kernel (nbclient + ipykernel). A function
defined in a cell all-reduces a tensor on 2 gloo ranks; nothing is left running afterwards."""

from __future__ import annotations

import json
import re

import psutil
import pytest

nbformat = pytest.importorskip("nbformat", reason="test dependency: pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="test dependency: pip install -e '.[test]'")
pytest.importorskip("ipykernel", reason="test dependency: pip install -e '.[test]'")

DEFINE = '''
import os
import torch
import torch.distributed as dist

def all_reduce_rank(scale):
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)]) * scale
    dist.all_reduce(value)
    dist.destroy_process_group()
    return {"rank": int(os.environ["RANK"]), "sum": value.item(), "pid": os.getpid()}
'''

LAUNCH = '''
import ddprun, json
results = ddprun.launch(all_reduce_rank, 2.0, cpu=True, nproc=2, log_dir={logs!r})
print("RESULTS " + json.dumps(results))
'''


def test_a_function_defined_in_a_notebook_cell_runs_on_every_rank(tmp_path, cpu_env, monkeypatch):
    for name, value in cpu_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(DEFINE),
        nbformat.v4.new_code_cell(LAUNCH.format(logs=str(tmp_path / "logs"))),
    ])
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel():
        kernel_pid = client.km.provisioner.process.pid
        client.execute_cell(notebook.cells[0], 0)
        client.execute_cell(notebook.cells[1], 1)
        left = [p.pid for p in psutil.Process(kernel_pid).children(recursive=True)]
    streams = "".join(o.get("text", "") for o in notebook.cells[1].outputs if o.get("output_type") == "stream")
    printed = re.sub(r"\x1b\[[0-9;]*m", "", streams)  # Jupyter shows the launcher's colours
    line = next(line for line in printed.splitlines() if line.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS "):])
    assert [(r["rank"], r["sum"]) for r in results] == [(0, 6.0), (1, 6.0)]
    assert "world         2 = 1 node(s) x 2 process(es), backend gloo" in printed  # the launcher's panel, in the cell
    assert left == []  # no launcher, worker or watchdog below the kernel once the cell is done
    assert not any(psutil.pid_exists(r["pid"]) and psutil.Process(r["pid"]).status() != psutil.STATUS_ZOMBIE
                   for r in results)
