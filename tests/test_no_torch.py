"""--help and --dry-run never import torch (nor psutil): they stay instant."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import SCRIPTS

PROBE = """
import sys
from ddprun.cli import main
sys.argv = ["ddprun", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
print("TORCH" if "torch" in sys.modules else "NO-TORCH", file=sys.stderr)
print("PSUTIL" if "psutil" in sys.modules else "NO-PSUTIL", file=sys.stderr)
"""


@pytest.mark.parametrize(
    "args",
    [["--help"], ["run", "--help"], ["train", "--help"], ["doctor", "--help"],
     ["run", "--dry-run", str(SCRIPTS / "allreduce.py")],
     ["run", "--dry-run", "--json", str(SCRIPTS / "allreduce.py")],
     ["train", "--dry-run"]],
)
def test_no_torch_import(args, cpu_env):
    result = subprocess.run([sys.executable, "-c", PROBE, *args], env=cpu_env, capture_output=True, text=True, timeout=60)
    assert result.stderr.strip().endswith("NO-TORCH\nNO-PSUTIL"), result.stderr
