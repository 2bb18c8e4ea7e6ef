"""moesnap: in-memory snapshots of PyTorch training state, held by the node's moesnapd.

A training loop adds four lines::

    client = moesnap.Client("/run/moesnap/agent.sock", rank)
    client.register_module("model", model); client.register_optimizer("optim", optimizer)
    start = client.restore() if client.latest_committed() is not None else 0
    ...  # in the loop: client.wait_captured() before optimizer.step(), client.snapshot(step) after it

See ``moesnap.Client`` for the whole API. Errors are ``moesnap.Error`` with the daemon's message.
``moesnap.load(directory)`` reads a step exported with ``moesnapctl export`` without a daemon.
"""

from ._moesnap import Error, Operator, SharedBuffer, SparseSchedule, plan
from .load import exported_step, load
from .torch_helpers import Client, RandomState, initialize_optimizer_state

__all__ = ["Client", "Error", "Operator", "RandomState", "SharedBuffer", "SparseSchedule", "plan",
           "initialize_optimizer_state", "load", "exported_step"]
