import pytest

from tests.e2e.stack import Stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory, real_model):
    """One real stack (prefill + decode workers with the default model, web under uvicorn) per test run."""
    s = Stack(tmp_path_factory.mktemp("stack"))
    try:
        yield s.start()
    finally:
        s.close()


@pytest.fixture
def own_stack(tmp_path):
    """A stack of this test's own, for tests that kill or misconfigure workers."""
    s = Stack(tmp_path)
    try:
        yield s
    finally:
        s.close()
