"""--help and --dry-run never import torch (nor psutil): they stay instant."""

from __future__ import annotations


import pytest

from conftest import SCRIPTS, heavy_imports




@pytest.mark.parametrize(
    "args",
    [["--help"], ["run", "--help"], ["train", "--help"], ["doctor", "--help"],
     ["run", "--dry-run", str(SCRIPTS / "allreduce.py")],
     ["run", "--dry-run", "--json", str(SCRIPTS / "allreduce.py")],
     ["train", "--dry-run"]],
)
def test_no_torch_import(args, cpu_env):
    assert heavy_imports(args, env=cpu_env) == []
