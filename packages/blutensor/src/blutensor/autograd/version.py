"""The version counter a tensor shares with its views; every in-place change bumps it, and
backward compares it with the value recorded when a tensor was saved."""

from __future__ import annotations


class Version:
    """A mutable integer shared by a tensor and its views (``.v``)."""

    __slots__ = ("v",)

    def __init__(self):
        self.v = 0

    def __repr__(self) -> str:
        return f"Version({self.v})"
