"""dev/sass_diff.py takes its revision as an argument, never into a shell: a hostile one is a named refusal."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("sass_diff", ROOT / "dev" / "sass_diff.py")
sass_diff = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_diff)


@pytest.mark.parametrize("rev", ["HEAD; touch {marker}", "$(touch {marker})", "--output={marker}", "no-such-rev"])
def test_hostile_revision_is_refused_and_runs_nothing(tmp_path, rev):
    marker = tmp_path / "pwned"
    with pytest.raises(SystemExit, match="is not a commit"):
        sass_diff.extract_rev(rev.format(marker=marker), tmp_path)
    assert not marker.exists()


def test_extracts_the_kernels_of_a_commit(tmp_path):
    sass_diff.extract_rev("HEAD", tmp_path)
    cus = list((tmp_path / "old" / sass_diff.KERNEL_DIRS[0]).glob("*.cu"))
    assert cus and all(c.stat().st_size for c in cus)
