"""World-size-1 backend: every collective is the identity (or a copy), so code runs without MPI."""

from __future__ import annotations

from typing import Any

from ..process_group import CollectiveError, CompletedWork, ProcessGroup, Work


class LocalProcessGroup(ProcessGroup):
    """A group of one process; works on NumPy and CuPy arrays alike."""

    backend = "local"

    def __init__(self, global_rank: int = 0):
        super().__init__(0, 1, (global_rank,))

    def _all_reduce(self, a: Any, op: str) -> Work:
        return CompletedWork((a,))  # sum/avg/max/min/prod of one value is that value

    def _reduce_scatter(self, o: Any, i: Any, op: str) -> Work:
        o.reshape(-1)[...] = i.reshape(-1)
        return CompletedWork((o,))

    def _all_gather(self, o: Any, i: Any) -> Work:
        o.reshape(-1)[...] = i.reshape(-1)
        return CompletedWork((o,))

    def _broadcast(self, a: Any, src: int) -> Work:
        return CompletedWork((a,))

    def _all_to_all(self, o: Any, i: Any) -> Work:
        o.reshape(-1)[...] = i.reshape(-1)
        return CompletedWork((o,))

    def _send(self, a: Any, dst: int, tag: int) -> Work:  # unreachable: _peer refuses dst == rank
        raise CollectiveError("send: a group of one process has no peer")

    def _recv(self, a: Any, src: int, tag: int) -> Work:
        raise CollectiveError("recv: a group of one process has no peer")

    def _barrier(self) -> Work:
        return CompletedWork()

    def _new_group(self, ranks: list[int], group_index: int) -> ProcessGroup | None:
        return LocalProcessGroup(self.global_ranks[0])
