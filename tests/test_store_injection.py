"""A second local user cannot make a job unpickle their data through its rendezvous store.

torch's c10d rendezvous keeps its state as a pickle under `torch.rendezvous.<run id>` in a
store that every local user can reach on 127.0.0.1. ddprun's run id is 128 random bits that
appear nowhere another user can read, so the attacker below reaches the stores, writes a
payload under every id it can find, and still nothing runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, ddprun_command

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attacker drops from root to nobody")


def _wait_for(path_glob: list[Path], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(p.exists() for p in path_glob):
            return True
        time.sleep(0.2)
    return False


def test_pickles_written_by_another_user_under_every_visible_id_never_run(cpu_env, tmp_path):
    out = Path(cpu_env["OUT_DIR"])
    marker = tmp_path / "pwned"
    tmp_path.chmod(0o777)
    logs = tmp_path / "logs"
    job = subprocess.Popen(ddprun_command() + ["run", "--cpu", "--log-dir", str(logs), str(SCRIPTS / "wait_for_go.py")],
                           env=cpu_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_for([out / "ready0", out / "ready1"], timeout=60), "the job never started"
        job_ids = [p.name for p in logs.iterdir()]  # more than another user can see: the job's folder name
        attack = subprocess.run([sys.executable, str(SCRIPTS / "store_attacker.py"), str(marker), *job_ids],
                                capture_output=True, text=True, timeout=60, env=cpu_env)
        assert attack.returncode == 0, attack.stderr
        reached = int(re.search(r"reached (\d+) stores", attack.stdout).group(1))
        assert reached >= 1, "the attacker could not reach the job's store: the test proves nothing"
        (out / "go").touch()
        stdout, stderr = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, stderr
    assert stdout.count("sum 2.0") == 2
    assert not marker.exists(), "an injected pickle ran inside the job"
