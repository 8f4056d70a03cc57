"""The summary table: top kernels by total time, calls, mean, share of the step; peak memory by owner."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bluprofiler.result import ProfileResult


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def format_table(res: ProfileResult, top: int = 25, sort_by: str = "total") -> str:
    """A fixed-width text table of ``res.summary()`` followed by the peak-memory breakdown."""
    rows = res.summary(sort_by=sort_by)
    timed = "GPU" if res.gpu_timing else "host"
    head = (f"bluprofiler: {len(res.ops())} op spans on {res.device}, step time {res.step_ms():.3f} ms "
            f"(wall {res.wall_ms:.3f} ms), times measured on the {timed}\n")
    cols = ["name", "kernel", "calls", f"total ms ({timed})", "self ms", "mean us", "share %"]
    if res.gpu_timing:
        cols.append("host ms")
    lines = []
    w0 = max([len(cols[0])] + [len(r["name"]) for r in rows[:top]])
    w1 = max([len(cols[1])] + [len(r["kernel"]) for r in rows[:top]])
    fmt = (f"{{:<{w0}}}  {{:<{w1}}}  {{:>7}}  {{:>16}}  {{:>10}}  {{:>11}}  {{:>8}}"
           + ("  {:>10}" if res.gpu_timing else ""))
    lines.append(fmt.format(*cols))
    lines.append("-" * len(lines[0]))
    for r in rows[:top]:
        total = "host-only" if r.get("host_only") else f"{r['total_ms']:.3f}"
        vals = [r["name"], r["kernel"], r["calls"], total, f"{r['self_ms']:.3f}",
                f"{r['mean_us']:.1f}", f"{r['share']:.1f}"]
        if res.gpu_timing:
            vals.append(f"{r['cpu_ms']:.3f}")
        lines.append(fmt.format(*vals))
    if len(rows) > top:
        rest = rows[top:]
        lines.append(f"... {len(rest)} more rows, {sum(r['self_ms'] for r in rest):.3f} ms self time in total")
    if any(r.get("host_only") for r in rows):
        lines.append("host-only: view ops (no kernel launched), timed on the host only (no CUDA events; "
                     "their host time is in the host ms column)")
    total = sum(r["self_ms"] for r in rows)
    lines.append(f"sum of op self times: {total:.3f} ms = {100 * total / (res.step_ms() or 1e-9):.1f}% of the step "
                 f"(the rest: Python between ops, optimizer and other work outside ops)")
    if res.mem_events:
        p = res.peak_memory()
        lines.append("")
        lines.append(f"memory: peak {_mib(p['peak_bytes'])} above the start ({p['n_alloc']} allocations, "
                     f"{p['n_free']} frees; baseline {_mib(p['baseline_bytes'])}); live at the peak by owner:")
        if res.meta.get("memory_source"):
            lines.append(f"  (source: {res.meta['memory_source']})")
        for owner, n in list(p["by_owner"].items())[:15]:
            lines.append(f"  {owner:<40} {_mib(n):>16}")
    if res.comms:
        lines.append("")
        lines += format_comm_table(res)
    return head + "\n".join(lines) + "\n"


def _bytes(n: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{int(n)} B"


def format_comm_table(res: ProfileResult) -> list[str]:
    """The collectives section: per (op, group) calls, bytes, time, algbw/busbw and overlap with compute."""
    rows = res.comm_summary()
    gpu = any(r["gpu_timed"] for r in rows)
    total = sum(r["total_ms"] for r in rows)
    clock = "GPU (CUDA events on the communication stream)" if gpu else "host: call to completed wait"
    out = [f"collectives: {len(res.comms)} on {', '.join(sorted({r['backend'] for r in rows}))}, "
           f"{total:.3f} ms in total ({clock}); bus bandwidth by NCCL's formulas; "
           "overlap = share of the time covered by op spans"]
    cols = ["collective", "group", "calls", "bytes", "total ms", "mean us", "algbw GB/s", "busbw GB/s", "overlap %"]
    w1 = max([len(cols[1])] + [len(",".join(map(str, r["group"]))) for r in rows])
    fmt = f"{{:<15}}  {{:<{w1}}}  {{:>6}}  {{:>11}}  {{:>10}}  {{:>10}}  {{:>10}}  {{:>10}}  {{:>9}}"
    out.append(fmt.format(*cols))
    out.append("-" * len(out[-1]))
    for r in rows:
        out.append(fmt.format(r["op"], ",".join(map(str, r["group"])), r["calls"], _bytes(r["bytes"]),
                              f"{r['total_ms']:.3f}", f"{r['mean_us']:.1f}", f"{r['algbw_GBps']:.4g}",
                              f"{r['busbw_GBps']:.4g}", f"{100 * r['overlap']:.1f}"))
    if res.meta.get("collectives_unfinished"):
        out.append(f"({res.meta['collectives_unfinished']} collective(s) issued but not waited on before the session "
                   "ended are not listed)")
    return out
