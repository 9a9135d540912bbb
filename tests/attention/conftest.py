import pytest

from longattn.attention import force_path


@pytest.fixture(params=["cpu", "gpu"])
def path(request):
    """Runs the test on the CPU path and again on the GPU path (forced on CPU tensors): a fast path
    checked against its float64 reference on both. Where a mechanism's code is the same on both
    paths, this is the proof that its GPU path is right."""
    with force_path(request.param):
        yield request.param
