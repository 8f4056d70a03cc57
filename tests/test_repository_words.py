"""The repository speaks of the software alone: no tracked file talks about how it was developed.

Every file ``git ls-files`` lists (text files; binary ones are skipped) is searched line by line for the
case-insensitive patterns of ``PATTERNS``: numbered work sessions and rounds, GPU-time bookkeeping, one machine's
output folders (its home directories, its random temporary directories) and private package directory, the
scratch snapshot directory and the one-off run scripts, runs numbered in the order they happened ("run 3", "the
first run on the H200", ``*_run1.json``, ``check2``) instead of named for what they measure, issue numbers and
people's roles. A hit fails the test with ``file:line: the line`` for each. The tracked file names themselves are
checked too, against the same patterns and ``NAME_PATTERNS`` (a hit reads ``path: [match] (file name)``).
Technical uses of the same words (a profiler session, a restart budget, kernel time attributed to an op, a
training run's checkpoints, a run of equal indices, a program's first run) do not match the patterns. The
patterns and their literals are spelled in pieces so that this file does not hit the words it looks for.
"""

from __future__ import annotations

import json
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
    # one machine's absolute output folders: a home directory, a random temporary directory (tempfile.mkdtemp's
    # eight-character suffix, pytest's per-user base); results record OUTDIR or a repository-relative path
    r"(?<![\w.~-])/ro" r"ot/": ("/ro" "ot/",),
    r"(?<![\w.~-])/ho" r"me/\w+/": ("/ho" "me/",),
    r"/t" r"mp/(?:tmp|[\w.-]*_)[a-z0-9_]{8}/": ("/t" "mp/",),
    r"/t" r"mp/pytest-of-": ("/t" "mp/pytest-of-",),
    # runs numbered in the order they happened, instead of said what they measured
    r"\b(?:[HAB]\d{3}|GPU|CUDA) ru" r"ns? #?\d+\b": ("ru" "n",),
    r"(?:\.py`?|\.sh`?|\bgpu_\w+) ru" r"ns? #?\d+\b": ("ru" "n",),
    r"\(ru" r"ns? #?\d+\b": ("(ru" "n",),
    r"\bru" r"ns? #\d+": ("ru" "n #", "ru" "ns #"),
    r"\b(?:first|second|third|fourth|last|previous|earlier) (?:end-to-end|e2e|GPU|benchmark|measured|timing) "
    r"ru" r"ns?\b": ("ru" "n",),
    r"\b(?:first|second|third|fourth|last|previous|earlier) ru" r"ns? on (?:the |an? |one )?"
    r"(?:[HAB]\d{3}|GPU|device|machine)\b": ("ru" "n",),
    r"[_-](?:ru" r"n|che" r"ck|try|attempt)\d+\b": ("ru" "n", "che" "ck", "try", "attempt"),
    r"\b(?:ru" r"n|che" r"ck)\d+\.(?:json|jsonl|csv|txt|log|md|png)\b": ("ru" "n", "che" "ck"),
    r"\bche" r"ck\d+\b": ("che" "ck",),
}

#: patterns only for tracked file NAMES (matched against the path, case-insensitively): a results file named for the
#: one-off script that wrote it, not for what it measures
NAME_PATTERNS: tuple[str, ...] = (
    r"^benchmarks/results/(?:.*/)?gpu_" r"check[^/]*$",
)

#: tracked files exempt from the check (none: every file is checked)
PENDING: tuple[str, ...] = ()

#: third-party files kept verbatim (upstream text, not ours to reword)
THIRD_PARTY: tuple[str, ...] = (
    "packages/blutensor/tests/compat/nanogpt_model.py",
)

COMPILED = [(re.compile(p, re.IGNORECASE), needles) for p, needles in PATTERNS.items()]
PROCESS_WORDS = re.compile("|".join(f"(?:{p})" for p in PATTERNS), re.IGNORECASE)
NAME_WORDS = [re.compile(p, re.IGNORECASE) for p in NAME_PATTERNS]


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


def find_process_names(paths: list[str]) -> list[str]:
    """``path: [match] (file name)`` for every path (relative to the root, ``/``-separated) whose name matches
    ``PATTERNS`` or ``NAME_PATTERNS``: a file is named for what it holds, not for when or how often it was made."""
    hits = []
    for rel in paths:
        if rel in THIRD_PARTY:
            continue
        m = PROCESS_WORDS.search(rel) or next((m for rx in NAME_WORDS if (m := rx.search(rel))), None)
        if m:
            hits.append(f"{rel}: [{m.group(0)}] (file name)")
    return hits


def test_patterns_catch_process_words():
    # the examples are spelled in pieces, so that this file itself reads as what it checks for
    for bad in ("as measured in sess" "ion 5", "written to $O" "UT/x", "dev/gpu_" "batch9.sh", "see iss" "ue #8",
                "fixed (" "#12)", "cd .sn" "ap && make", "PYTHONPATH=a:/tmp/" "site", "the " "lead's run",
                "DESIGN" ".md section 5", "the pa" "per's Table 1", "skipped by the time " "budget",
                "device " "time left", '"dir": "/ro' 'ot/out/prof/trace"', "cache in /ho" "me/alice/blu/",
                '"cubin": "/t' 'mp/blublas_wgmma_27_nqmrr/cache/k.cubin"', "/t" "mp/tmpa1b2_c3d/x.json",
                "/t" "mp/pytest-of-me/pytest-7/x", "H200 ru" "n 3: BF16 0.705x", "H100 ru" "ns 2",
                "(`dev/gpu_check_memkern.py` ru" "n 2, kernels", "gpu_check_simt ru" "n 1", "GELU (ru" "n 1, before",
                "see ru" "n #4", "first ru" "n on the H200: 268/270", "the first end-to-end ru" "n",
                "e2e_gpt2_fp32_h200_ru" "n1.json", "blutensor_kernels_h200_che" "ck2.json", "out-try" "3/",
                "ru" "n2.json", "the che" "ck2 numbers"):
        assert PROCESS_WORDS.search(bad), bad
        m = PROCESS_WORDS.search(bad)
        # the literal prefilter lets every match through: some literal of a matching pattern occurs in it
        assert any(rx.search(bad) and any(n in m.group(0).lower() for n in needles) for rx, needles in COMPILED), bad
    for fine in ("a profiler sess" "ion", "restart bud" "get of 2 spent", "GPU " "time 0 for view ops",
                 "round to nearest even", "the issue slots are busy", "snapshot()", "x = round(y, 3)",
                 "blutrain prepare --out /t" "mp/gpt2data", "--target /t" "mp/blutrain-site", "OUTDIR/gpt2_124m/",
                 "an earlier ru" "n's checkpoints", "the first ru" "n of each compiled program",
                 "run p sits PROW rows after ru" "n 0", "a ru" "n of equal indices", "tmp_path / \"ru" "n2\"",
                 "~/.cache/ro" "ot/x", "the check passes on 2 ranks", "e2e_gpt2_fp32_h200_3xtf32_k4096.json"):
        assert not PROCESS_WORDS.search(fine), fine


def test_hits_name_file_and_line(tmp_path):
    word = "sess" + "ion 3"  # spelled in pieces, as the examples above
    (tmp_path / "notes.txt").write_text(f"clean line\nmeasured in {word} on the H200\nclean again\n")
    (tmp_path / "blob.bin").write_bytes(b"\0\0" + word.encode())
    hits = find_process_words([str(tmp_path / "notes.txt"), str(tmp_path / "blob.bin"), str(tmp_path / "gone.txt")])
    assert hits == [f"{tmp_path / 'notes.txt'}:2: [{word}] measured in {word} on the H200"]


def test_file_names_are_checked():
    bad = ["benchmarks/results/e2e_gpt2_h200_ru" "n1.json", "benchmarks/results/kernels_che" "ck2.json",
           "benchmarks/results/prof/gpu_" "check.json", "dev/gpu_" "batch7.sh", "notes/sess" "ion3.md"]
    good = ["benchmarks/results/e2e_gpt2_fp32_h200_3xtf32_k4096.json", "benchmarks/results/prof/profile_gpt2.json",
            "packages/blublas/tests/test_wgmma_guard.py", "tests/test_repository_words.py"]
    hits = find_process_names(bad + good)
    assert [h.split(":")[0] for h in hits] == bad, hits
    assert hits[0] == f"{bad[0]}: [_ru" "n1] (file name)"


def test_pending_files_exist():
    tracked = set(_tracked_files())
    missing = [p for p in PENDING + THIRD_PARTY if p not in tracked]
    assert not missing, f"allow-listed files that are not tracked (drop them from the list): {missing}"


#: how a result's command starts: environment assignments, then an interpreter or a program of this checkout (a bare
#: ``benchmarks/x.py`` does not run on its own)
COMMAND_START = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=(?:\$\([^)]*\)|\S+) )*"
                           r"(?:python3?|\.venv/bin/python|pytest|bash|git|(?:benchmarks|scripts|dev)/[\w/.-]+\.sh)\s")
HASH = re.compile(r"^[0-9a-f]{7,40}$")
#: a script of this checkout named in a command
SCRIPT = re.compile(r"(?<![\w/.$-])((?:benchmarks|packages|dev|scripts)/[\w/.*-]+\.(?:py|sh))\b")


def _hashes(d: dict) -> list[str] | None:
    """The commit(s) ``d`` names under ``commit`` or ``command_commit`` (a string or a dict of them), else None."""
    for key in ("commit", "command_commit"):
        v = d.get(key)
        if isinstance(v, str):
            return [v]
        if isinstance(v, dict) and v:
            return [str(x) for x in v.values()]
    return None


def missing_objects(names: set[str]) -> set[str]:
    """Those of ``names`` (git object names: ``HASH^{commit}``, ``HASH:path``) that name nothing in this
    repository, or more than one thing."""
    check = subprocess.run(["git", "cat-file", "--batch-check"], cwd=ROOT, capture_output=True, text=True,
                           input="".join(f"{n}\n" for n in sorted(names)), timeout=60)
    return {line.split()[0] for line in check.stdout.splitlines()
            if line.endswith(" missing") or " ambiguous" in line}


def missing_commits(hashes: set[str]) -> set[str]:
    """Those of ``hashes`` that name no commit of this repository (or more than one)."""
    return {n.removesuffix("^{commit}") for n in missing_objects({f"{h}^{{commit}}" for h in hashes})}


def result_problems(rel: str, doc: object) -> list[str]:
    """What keeps the result ``doc`` (a results JSON, ``rel`` its path) from being rerun: no command, a command
    that does not start with an interpreter or program, or no commit (``commit``/``command_commit`` at the top or
    in every run of ``runs``, an abbreviated hash or a dict of them)."""
    if not isinstance(doc, dict):
        return [f"{rel}: not a JSON object"]
    runs = [r for r in doc["runs"].values() if isinstance(r, dict)] if isinstance(doc.get("runs"), dict) else []
    problems = []
    commands = [doc.get("command")] + [r["command"] for r in runs if "command" in r]
    if not isinstance(doc.get("command"), str) or not doc["command"].strip():
        problems.append(f"{rel}: no 'command'")
    for cmd in commands:
        if isinstance(cmd, str) and not COMMAND_START.match(cmd + " "):
            problems.append(f"{rel}: command does not start with an interpreter or program: {cmd[:80]!r}")

    found = _hashes(doc)
    if found is None and runs and all(_hashes(r) is not None for r in runs):
        found = [h for r in runs for h in _hashes(r) or ()]
    if found is None:
        problems.append(f"{rel}: no 'commit' (or 'command_commit'), at the top or in every run")
    for h in [*(found or ()), *(h for r in runs for h in _hashes(r) or ())]:
        if not HASH.match(h):
            problems.append(f"{rel}: commit {h!r} is not a hash")
    return problems


def command_scripts(doc: dict) -> list[tuple[str, str, list[str]]]:
    """(command, a script of this checkout it runs, the commits it reruns at) for the result ``doc`` and its
    runs: the run's own commits, else the result's, else (a command shared by runs) every run's."""
    runs = [r for r in doc["runs"].values() if isinstance(r, dict)] if isinstance(doc.get("runs"), dict) else []
    top = _hashes(doc) or [h for r in runs for h in _hashes(r) or ()]
    items = [(doc.get("command"), top)] + [(r["command"], _hashes(r) or top) for r in runs if "command" in r]
    return [(cmd, path, commits) for cmd, commits in items if isinstance(cmd, str)
            for path in SCRIPT.findall(cmd) if "*" not in path and "$" not in path]


def test_result_problems_found():
    assert result_problems("r.json", {"command": "python3 b.py --out OUT.json", "commit": "abc1234"}) == []
    assert result_problems("r.json", {"command": "PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 b.py",
                                      "commit": {"runs": "abc1234", "curve": "def5678"}}) == []
    assert result_problems("r.json", {"command": "benchmarks/gpu_suite.sh recipe DATA OUT.json",
                                      "runs": {"a": {"commit": "abc1234"}, "b": {"commit": "def5678"}}}) == []
    assert result_problems("r.json", {"command": "benchmarks/e2e_llama.py --small", "commit": "abc1234"}) == [
        "r.json: command does not start with an interpreter or program: 'benchmarks/e2e_llama.py --small'"]
    assert result_problems("r.json", {"command": "python3 b.py"}) == [
        "r.json: no 'commit' (or 'command_commit'), at the top or in every run"]
    assert result_problems("r.json", {"command": "python3 b.py", "runs": {"a": {"commit": "abc1234"}, "b": {}}}) == [
        "r.json: no 'commit' (or 'command_commit'), at the top or in every run"]
    assert result_problems("r.json", {"command": "python3 b.py", "commit": "the tree after"}) == [
        "r.json: commit 'the tree after' is not a hash"]
    assert result_problems("r.json", {"commit": "abc1234"}) == ["r.json: no 'command'"]
    head = subprocess.run(["git", "rev-parse", "--short=9", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          timeout=30).stdout.strip()
    if head:  # a git checkout
        assert missing_commits({head, "0000000"}) == {"0000000"}
        assert missing_objects({f"{head}:{THIS}", f"{head}:benchmarks/nope.py"}) == {f"{head}:benchmarks/nope.py"}
    assert result_problems("r.json", {"command": "python3 b.py", "commit": "abc1234",
                                      "runs": {"a": {"commit": "abc1234 without its fix"}}}) == [
        "r.json: commit 'abc1234 without its fix' is not a hash"]
    doc = {"command": "pytest benchmarks/k/bench.py && python3 benchmarks/k/summarize.py B.json OUT.json",
           "commit": "abc1234", "runs": {"a": {"command": "bash benchmarks/ck.sh OUT.json", "commit": "def5678"}}}
    assert command_scripts(doc) == [(doc["command"], "benchmarks/k/bench.py", ["abc1234"]),
                                    (doc["command"], "benchmarks/k/summarize.py", ["abc1234"]),
                                    ("bash benchmarks/ck.sh OUT.json", "benchmarks/ck.sh", ["def5678"])]


def test_results_name_a_command_and_a_commit():
    """Every JSON result under benchmarks/results names a command anyone can run from a checkout, and the commit
    it reruns at; where the checkout has the history, that commit exists and holds the scripts the command runs."""
    results = [p for p in _tracked_files() if p.startswith("benchmarks/results/") and p.endswith(".json")]
    assert results
    problems = []
    for rel in results:
        doc = json.loads((ROOT / rel).read_text())
        problems += result_problems(rel, doc)
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                             text=True, timeout=30).stdout.strip() != "false"
    if not shallow:  # a shallow clone lacks the older commits: their form is checked above
        named = set()
        for rel in results:
            doc = json.loads((ROOT / rel).read_text())
            runs = list(doc["runs"].values()) if isinstance(doc.get("runs"), dict) else []
            for d in [doc, *[r for r in runs if isinstance(r, dict)]]:
                for key in ("commit", "command_commit", "baseline_commit"):
                    v = d.get(key)
                    for h in [v] if isinstance(v, str) else list(v.values()) if isinstance(v, dict) else []:
                        if HASH.match(str(h)):
                            named.add((rel, str(h)))
        missing = missing_commits({h for _, h in named})
        problems += [f"{rel}: commit {h} is not in this repository" for rel, h in sorted(named) if h in missing]
        wanted = {}
        for rel in results:
            for _cmd, path, commits in command_scripts(json.loads((ROOT / rel).read_text())):
                for h in commits:
                    if HASH.match(h) and h not in missing:
                        wanted.setdefault(f"{h}:{path}", []).append(rel)
        absent = missing_objects(set(wanted))
        problems += [f"{rel}: {obj.split(':')[1]} is not in its commit {obj.split(':')[0]}"
                     for obj in sorted(absent) for rel in wanted[obj]]
    assert not problems, "results that cannot be rerun as recorded:\n" + "\n".join(problems)


def test_tree_speaks_of_the_software_alone():
    tracked = _tracked_files()
    hits = find_process_names(tracked) + find_process_words(tracked)
    assert not hits, "development-process words in tracked files:\n" + "\n".join(hits)
