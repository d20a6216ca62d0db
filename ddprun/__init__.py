"""ddprun: launch PyTorch DistributedDataParallel jobs that work the first time.

From Python (see ddprun.api): ddprun.launch(fn, *args, ...), ddprun.run_script(path, args, ...),
ddprun.plan(...), ddprun.JobFailed, ddprun.UsageError. Loaded on first use, so `import ddprun`
(and with it every CLI call and every rank) stays cheap.
"""

import importlib as _importlib
import sys as _sys
import types as _types

__version__ = "0.1.0"
__all__ = ["launch", "run_script", "plan", "JobFailed", "UsageError", "DdprunError", "__version__"]
_API = {"run_script", "JobFailed"}
_ERRORS = {"UsageError", "DdprunError"}
# ddprun's own modules ddprun/launch.py and ddprun/plan.py have the API's names. Each stays the
# module (`from ddprun import launch; launch.execute(...)`, `from ddprun.plan import LaunchPlan`)
# and is also callable: ddprun.launch(fn, ...) is ddprun.api.launch, ddprun.plan(...) ddprun.api.plan.
_CALLABLE_MODULES = {"launch", "plan"}


class _ApiModule(_types.ModuleType):
    def __call__(self, *args, **kwargs):
        from ddprun import api

        return getattr(api, self.__name__.rpartition(".")[2])(*args, **kwargs)


class _Package(_types.ModuleType):
    def __setattr__(self, name, value):
        if name in _CALLABLE_MODULES and type(value) is _types.ModuleType:
            value.__class__ = _ApiModule  # the import system binds the submodule here when it loads
        super().__setattr__(name, value)


def __getattr__(name):
    if name in _CALLABLE_MODULES:
        return _importlib.import_module(f"{__name__}.{name}")
    if name in _API:
        from ddprun import api

        return getattr(api, name)
    if name in _ERRORS:
        from ddprun import errors

        return getattr(errors, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_sys.modules[__name__].__class__ = _Package
