"""Chrome trace: valid JSON with host (and GPU) lanes, nested spans and memory counters."""

from __future__ import annotations

import json

import blutensor as bt
from bluprofiler import profile, record_function, write_chrome_trace


def _profiled(device):
    bt.manual_seed(0)
    x = bt.randn(16, 16, device=device, requires_grad=True)
    with profile() as prof:
        with record_function("step"):
            y = bt.sum(bt.exp(bt.matmul(x, x)))
            y.backward()
    return prof.result


def test_trace_is_loadable_and_complete(tmp_path, device):
    res = _profiled(device)
    p = write_chrome_trace(res, tmp_path / "t" / "trace.json")
    tr = json.loads(p.read_text())
    ev = tr["traceEvents"]
    assert tr["displayTimeUnit"] == "ms" and tr["otherData"]["producer"] == "bluprofiler"
    for e in ev:
        assert {"ph", "name", "pid"} <= set(e)
        if e["ph"] in ("X", "C", "s", "f"):
            assert isinstance(e["ts"], float | int) and e["ts"] >= 0
    host = [e for e in ev if e["ph"] == "X" and e["pid"] == 1]
    names = [e["name"] for e in host]
    assert names.count("matmul.forward") == 1 and names.count("matmul.backward") == 1
    assert {"step", "exp.forward", "exp.backward", "sum.forward", "sum.backward"} <= set(names)
    assert len(host) == len(res.events)
    # every op span lies inside the step region on the same thread
    step = next(e for e in host if e["name"] == "step")
    for e in host:
        assert e["tid"] == step["tid"]
        assert step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1e-3
    mm = next(e for e in host if e["name"] == "matmul.forward")
    assert mm["args"]["shapes"] == [[16, 16], [16, 16]]
    assert mm["args"]["kernel"] == "blutensor.matmul" if device == "cpu" else mm["args"]["kernel"]
    counters = [e for e in ev if e["ph"] == "C"]
    assert counters and all("allocated_MiB" in e["args"] for e in counters)
    meta = {e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    gpu = [e for e in ev if e["ph"] == "X" and e["pid"] == 2]
    if device == "cuda":
        assert "GPU" in meta and len(gpu) == len(res.ops())
        assert len([e for e in ev if e["ph"] == "s"]) == len(gpu)
    else:
        assert "GPU" not in meta and not gpu


def test_slices_nest_properly_per_track(device):
    """Perfetto needs slices on one track to nest (no partial overlaps): check a GPT step."""
    from bluprofiler.demo import make_gpt_step

    step, _ = make_gpt_step("tiny", device=device)
    step()
    with profile() as prof:
        with record_function("step"):
            step()
    ev = prof.result.chrome_trace()["traceEvents"]
    tracks: dict = {}
    for e in ev:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert tracks
    for spans in tracks.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack = []
        for a, b in spans:
            while stack and stack[-1] <= a + 1e-6:
                stack.pop()
            assert not stack or b <= stack[-1] + 1e-3, "partial overlap"
            stack.append(b)
