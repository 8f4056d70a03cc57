"""The repository speaks of the software alone: no tracked file talks about how it was developed.

Every file ``git ls-files`` lists (text files; binary ones are skipped) is searched line by line for the
case-insensitive patterns of ``PATTERNS``: numbered work sessions and rounds, GPU-time bookkeeping, one machine's
output folder and private package directory, the scratch snapshot directory and the one-off run scripts, issue
numbers and people's roles. A hit fails the test with ``file:line: the line`` for each. Technical uses of the
same words (a profiler session, a restart budget, kernel time attributed to an op) do not match the patterns.
The patterns and their literals are spelled in pieces so that this file does not hit the words it looks for.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()

#: development-process vocabulary (regex, matched case-insensitively) -> the lower-case literals one of which any
#: match contains: a file is searched with a pattern only when one of its literals occurs (a fast substring test)
PATTERNS: dict[str, tuple[str, ...]] = {
    r"\bsessions? \d": ("session",),
    r"\bsession\d": ("session",),
    r"\b(?:work|development) rounds?\b": ("round",),
    r"\bround \d+ of\b": ("round",),
    r"\$O" r"UT\b": ("$o" "ut",),
    r"gpu_" r"batch(?!ed)": ("gpu_" "batch",),
    r"\bdevice[- ]" r"time\b": ("device " "time", "device-" "time"),
    r"\bGPU[- ]" r"time (?:budget|left|spent|used)\b": ("gpu " "time", "gpu-" "time"),
    r"\bGPU[- ]hours?\b": ("gpu hour", "gpu-hour"),
    r"budget" r"_left": ("budget" "_left",),
    r"\btime budget\b": ("time budget",),
    r"/tmp/" r"site\b": ("/tmp/" "site",),
    r"(?<![\w\])])\.sn" r"ap\b": (".sn" "ap",),
    r"\bsnap\.sh\b": ("snap.sh",),
    r"\bgpu_env\.sh\b": ("gpu_env.sh",),
    r"carried wheels?": ("carried wheel",),
    r"\bthe " r"lead\b": ("the " "lead",),
    r"\blead's\b": ("lead's",),
    r"\bissues? #?\d+": ("issue",),
    r"\(#\d+\)": ("(#",),
    r"(?-i:\bDESIGN\.md\b)": ("design.md",),
    r"\bthe paper'?s?\b": ("the paper",),
    r"/work/\.library": ("/work/.library",),
    r"\bdevice tool\b": ("device tool",),
}

#: tracked files exempt from the check (none: every file is checked)
PENDING: tuple[str, ...] = ()

#: third-party files kept verbatim (upstream text, not ours to reword)
THIRD_PARTY: tuple[str, ...] = (
    "packages/blutensor/tests/compat/nanogpt_model.py",
)

COMPILED = [(re.compile(p, re.IGNORECASE), needles) for p, needles in PATTERNS.items()]
PROCESS_WORDS = re.compile("|".join(f"(?:{p})" for p in PATTERNS), re.IGNORECASE)


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as e:  # not a git checkout (an sdist, say)
        pytest.skip(f"git ls-files unavailable: {e}")
    return [p for p in out.stdout.decode().split("\0") if p]


def find_process_words(paths: list[str]) -> list[str]:
    """``file:line: text`` for every line of ``paths`` (relative to the root) that matches ``PATTERNS``."""
    skip = {THIS, *PENDING, *THIRD_PARTY}
    hits = []
    for rel in paths:
        if rel in skip:
            continue
        path = ROOT / rel
        try:
            data = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError):  # deleted in the work tree, or a submodule
            continue
        if b"\0" in data[:8192]:
            continue  # binary (images, archives)
        text = data.decode("utf-8", errors="replace")
        lower = text.lower()
        found = [rx for rx, needles in COMPILED if any(n in lower for n in needles)]
        if not found or not any(rx.search(text) for rx in found):
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            m = next((m for rx in found if (m := rx.search(line))), None)
            if m:
                hits.append(f"{rel}:{lineno}: [{m.group(0)}] {line.strip()[:200]}")
    return hits


def test_patterns_catch_process_words():
    # the examples are spelled in pieces, so that this file itself reads as what it checks for
    for bad in ("as measured in sess" "ion 5", "written to $O" "UT/x", "dev/gpu_" "batch9.sh", "see iss" "ue #8",
                "fixed (" "#12)", "cd .sn" "ap && make", "PYTHONPATH=a:/tmp/" "site", "the " "lead's run",
                "DESIGN" ".md section 5", "the pa" "per's Table 1", "skipped by the time " "budget",
                "device " "time left"):
        assert PROCESS_WORDS.search(bad), bad
        m = PROCESS_WORDS.search(bad)
        # the literal prefilter lets every match through: some literal of a matching pattern occurs in it
        assert any(rx.search(bad) and any(n in m.group(0).lower() for n in needles) for rx, needles in COMPILED), bad
    for fine in ("a profiler sess" "ion", "restart bud" "get of 2 spent", "GPU " "time 0 for view ops",
                 "round to nearest even", "the issue slots are busy", "snapshot()", "x = round(y, 3)"):
        assert not PROCESS_WORDS.search(fine), fine


def test_hits_name_file_and_line(tmp_path):
    (tmp_path / "notes.txt").write_text("clean line\nmeasured in session 3 on the H200\nclean again\n")
    (tmp_path / "blob.bin").write_bytes(b"\0\0session 3")
    hits = find_process_words([str(tmp_path / "notes.txt"), str(tmp_path / "blob.bin"), str(tmp_path / "gone.txt")])
    assert hits == [f"{tmp_path / 'notes.txt'}:2: [session 3] measured in session 3 on the H200"]


def test_pending_files_exist():
    tracked = set(_tracked_files())
    missing = [p for p in PENDING + THIRD_PARTY if p not in tracked]
    assert not missing, f"allow-listed files that are not tracked (drop them from the list): {missing}"


def test_tree_speaks_of_the_software_alone():
    hits = find_process_words(_tracked_files())
    assert not hits, "development-process words in tracked files:\n" + "\n".join(hits)
