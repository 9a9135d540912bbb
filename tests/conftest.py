import os

import pytest
import torch

# Triton kernels run in Triton's interpreter on CPU tensors (longattn.attention._triton): the switch
# must be set before any kernel is compiled, so before the kernel modules are imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
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


@pytest.fixture
def lra_stub_data(monkeypatch):
    """The LRA tasks on the in-memory stand-in for longattn.data.lra (tests/lra_stub.py): no data files."""
    from lra_stub import API

    from longattn.tasks.lra import LRATask

    monkeypatch.setattr(LRATask, "data_api", API)
    return API
