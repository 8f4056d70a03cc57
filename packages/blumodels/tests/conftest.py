"""The repository's shared test support (testing/: the fake CUDA device) on sys.path for these tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "testing"))
