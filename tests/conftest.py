import os
import sys

import pytest
import torch

# Triton kernels run in Triton's interpreter on CPU tensors (longattn.attention._triton): the switch
# must be set before any kernel is compiled, so before the kernel modules are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Torch's threads: OMP_NUM_THREADS (CI exports 2, the cores it has), shared evenly among pytest-xdist's workers
# (``-n``: PYTEST_XDIST_WORKER_COUNT is set in each worker) so that two workers on two cores do not each spin two.
_THREADS = int(os.environ.get("OMP_NUM_THREADS", "2"))
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, _THREADS // _WORKERS))
# The grid commands choose workers x threads from OMP_NUM_THREADS, else from the cores given
# (longattn.experiment.threads): a test's grid trains in this process, one run at a time (its monkeypatched data
# and captured output with it), unless the test asks for --workers. Set, not defaulted: CI exports
# OMP_NUM_THREADS=2 for torch's own threads (read above), which would make every grid start two worker processes.
os.environ["OMP_NUM_THREADS"] = "1"


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect: the reliability table counts every marked item
def pytest_collection_modifyitems(config, items):
    from reliability import item_marks

    config.reliability_marks = [mark for item in items for mark in item_marks(item)]
    config.reliability_files = {str(item.path) for item in items}


def pytest_configure(config):
    config.addinivalue_line("markers", "bad_input(family, outcome, cases=1): a reliability case "
                            "(tests/reliability.py), counted in docs/reliability.md by tests/reliability_counts.py")


@pytest.fixture(autouse=True)
def _deterministic_seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _fresh_hf_registrations():
    """Each test registers its own options with transformers: take back what it registered (tests/hf, and the
    docs' examples that tests/test_docs.py runs). The registry is process-wide, and a pytest-xdist worker runs
    other files after this one. Looked up in sys.modules, so a test that never imports the bridge imports nothing."""
    bridge = sys.modules.get("longattn.hf")
    before = set(bridge.registered()) if bridge else set()
    yield
    bridge = sys.modules.get("longattn.hf")
    for key in set(bridge.registered()) - before if bridge else ():
        bridge.unregister(key)


@pytest.fixture
def lra_stub_data(monkeypatch):
    """The LRA tasks on the in-memory stand-in for longattn.data.lra (tests/lra_stub.py): no data files."""
    from lra_stub import API

    from longattn.tasks.lra import LRATask

    monkeypatch.setattr(LRATask, "data_api", API)
    return API


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without the plugin pytest skips it
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core this process may run on (its CPU affinity, which a container or ``taskset``
    narrows), not every core of the machine; the README's test command uses it."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
