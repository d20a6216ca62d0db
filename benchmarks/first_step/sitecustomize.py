"""Benchmarks only (bench_warm.py puts this folder on PYTHONPATH): every process that imports
torch's optimizers, whichever launcher started it, appends one line to $FIRST_STEP_STAMPS when
its first optimizer step ends: {"rank": RANK, "t": epoch seconds}.

It registers torch's public global hook (torch.optim.optimizer.register_optimizer_step_post_hook)
right after that module is imported, so a process that never imports torch (ddprun's launcher
for --help, a warm-start client) pays nothing but this file's own import. A warm-start server
registers it before it forks, so each rank stamps its own first step.
"""

import importlib.abc
import json
import os
import sys
import time

_MODULE = "torch.optim.optimizer"
_stamped = []  # per process: a forked rank starts with the server's empty list


def _stamp(optimizer, args, kwargs):
    if _stamped or "RANK" not in os.environ:
        return
    _stamped.append(True)
    with open(os.environ["FIRST_STEP_STAMPS"], "a") as stamps:
        stamps.write(json.dumps({"rank": int(os.environ["RANK"]), "t": time.time()}) + "\n")


class _HookOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = next(filter(None, (f.find_spec(name, path, target) for f in sys.meta_path if hasattr(f, "find_spec"))))
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.register_optimizer_step_post_hook(_stamp)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("FIRST_STEP_STAMPS"):
    sys.meta_path.insert(0, _HookOnImport())
