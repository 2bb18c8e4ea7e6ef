"""moesnap: in-memory snapshots of PyTorch training state, held by the node's moesnapd.

A training loop adds four lines::

    client = moesnap.Client("/run/moesnap/agent.sock", rank)
    client.register_module("model", model); client.register_optimizer("optim", optimizer)
    start = client.restore() if client.latest_committed() is not None else 0
    ...  # in the loop: client.wait_captured() before optimizer.step(), client.snapshot(step) after it

See ``moesnap.Client`` for the whole API. Errors are ``moesnap.Error`` with the daemon's message.
``moesnap.load(directory)`` reads a step exported with ``moesnapctl export`` without a daemon.

The package imports without PyTorch: ``moesnap.core`` (the client over raw shared memory, the
sparse schedule, the planner) needs none, and the PyTorch parts are imported when first used.
"""

import importlib
from typing import Any

from .core import Error, Operator, SharedBuffer, SparseSchedule, plan

# Names whose modules need PyTorch, imported on first use.
_WITH_TORCH = {"Client": "torch_helpers", "RandomState": "torch_helpers",
               "initialize_optimizer_state": "torch_helpers", "load": "exported",
               "exported_step": "exported"}

__all__ = ["Client", "Error", "Operator", "RandomState", "SharedBuffer", "SparseSchedule", "plan",
           "initialize_optimizer_state", "load", "exported_step"]


def __getattr__(name: str) -> Any:
    module = _WITH_TORCH.get(name)
    if module is None:
        raise AttributeError(f"module 'moesnap' has no attribute '{name}'")
    try:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    except ImportError as error:
        raise ImportError(f"moesnap.{name} needs PyTorch ({error}); moesnap.core works "
                          f"without it") from error
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
