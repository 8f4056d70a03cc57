"""The repository's shared test support (testing/: the fake CUDA device) on sys.path for these tests; every test
starts and ends with blublas's switches unread (blublas.settings.reset), so the BLUBLAS_* variables a test sets
before its first GEMM are the ones it runs under (a test that changes one later calls reset itself)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "testing"))


@pytest.fixture(autouse=True)
def _blublas_settings_unread():
    from blublas import settings

    settings.reset()
    yield
    settings.reset()
