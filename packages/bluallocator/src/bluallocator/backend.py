"""Device-memory backends: the interface the caching allocator drives, and a fake one for CPU tests.

The allocator never talks to CUDA directly; it calls a backend. ``FakeDeviceBackend`` simulates an
address space with a fixed capacity, streams with queued work and events, deterministically, so every
allocator rule can be tested on a machine without a GPU. ``CudaBackend`` (cuda_backend.py) is the real one.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from .errors import BackendOutOfMemory


@runtime_checkable
class DeviceBackend(Protocol):
    """What the caching allocator needs from a device: raw memory, free-memory query, streams, events."""

    device_id: int

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes`` of device memory; raise ``BackendOutOfMemory`` if the driver cannot."""

    def free(self, ptr: int) -> None:
        """Return memory obtained from :meth:`malloc` to the driver."""

    def mem_get_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device."""

    def current_stream(self) -> int:
        """Id (handle) of the stream that new work goes to."""

    def event_create(self) -> int:
        """Create an event handle (no timing)."""

    def event_record(self, event: int, stream: int) -> None:
        """Record ``event`` on ``stream``: it completes when the work queued so far on it completes."""

    def event_query(self, event: int) -> bool:
        """True when the recorded event has completed."""

    def event_synchronize(self, event: int) -> None:
        """Block the host until the event completed."""

    def event_destroy(self, event: int) -> None:
        """Release an event handle."""

    def is_capturing(self, stream: int) -> bool:
        """True while ``stream`` is being captured into a CUDA graph."""


class FakeDeviceBackend:
    """Deterministic simulated device: first-fit address space of ``capacity`` bytes, streams and events.

    Streams are plain ints. ``enqueue(stream)`` queues simulated work on a stream; it completes only on
    ``synchronize(stream)`` (or ``synchronize()`` for all), so tests decide exactly when events fire.
    """

    def __init__(self, capacity: int = 1 << 30, *, base: int = 0x7F00_0000_0000, alignment: int = 512,
                 device_id: int = 0) -> None:
        for name, v in (("capacity", capacity), ("base", base), ("alignment", alignment), ("device_id", device_id)):
            if isinstance(v, bool) or not hasattr(type(v), "__index__"):
                raise TypeError(f"FakeDeviceBackend: {name} must be an int, got {type(v).__name__} {v!r}")
        if capacity <= 0:
            raise ValueError(f"FakeDeviceBackend: capacity must be positive, got {capacity}")
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"FakeDeviceBackend: alignment must be a power of two, got {alignment}")
        if base < 0 or base % alignment:
            raise ValueError(f"FakeDeviceBackend: base must be a non-negative multiple of alignment ({alignment}), "
                             f"got {base:#x}")
        self.device_id = device_id
        self.capacity = capacity
        self.alignment = alignment
        self.base = base
        self._free_ranges: list[tuple[int, int]] = [(base, capacity)]  # sorted (start, size)
        self._live: dict[int, int] = {}
        self.num_mallocs = 0
        self.num_frees = 0
        self.fail_next_mallocs = 0  # tests: make the next N mallocs fail as if out of memory
        self._stream = 0
        self._submitted: dict[int, int] = {}
        self._completed: dict[int, int] = {}
        self._events: dict[int, tuple[int, int] | None] = {}
        self._next_event = 1
        self.events_created = 0
        self._capturing: set[int] = set()

    # --- memory ---
    @property
    def used(self) -> int:
        """Bytes currently handed out to callers of :meth:`malloc`."""
        return sum(self._live.values())

    def malloc(self, nbytes: int) -> int:
        """First-fit allocation from the simulated address space."""
        if nbytes <= 0:
            raise ValueError(f"FakeDeviceBackend.malloc: nbytes must be positive, got {nbytes}")
        if self.fail_next_mallocs > 0:
            self.fail_next_mallocs -= 1
            raise BackendOutOfMemory(f"fake device: injected failure for {nbytes} bytes")
        size = -(-nbytes // self.alignment) * self.alignment
        for i, (start, rsize) in enumerate(self._free_ranges):
            if rsize >= size:
                if rsize == size:
                    del self._free_ranges[i]
                else:
                    self._free_ranges[i] = (start + size, rsize - size)
                self._live[start] = size
                self.num_mallocs += 1
                return start
        raise BackendOutOfMemory(
            f"fake device: cannot allocate {nbytes} bytes "
            f"({self.capacity - self.used} free of {self.capacity})")

    def free(self, ptr: int) -> None:
        """Return a range and merge it with free neighbours."""
        size = self._live.pop(ptr, None)
        if size is None:
            raise ValueError(f"FakeDeviceBackend.free: {ptr:#x} was not allocated (or freed twice)")
        self.num_frees += 1
        i = bisect.bisect_left(self._free_ranges, (ptr, 0))
        self._free_ranges.insert(i, (ptr, size))
        if i + 1 < len(self._free_ranges) and ptr + size == self._free_ranges[i + 1][0]:
            self._free_ranges[i] = (ptr, size + self._free_ranges[i + 1][1])
            del self._free_ranges[i + 1]
        if i > 0 and sum(self._free_ranges[i - 1]) == ptr:
            start, prev_size = self._free_ranges[i - 1]
            self._free_ranges[i - 1] = (start, prev_size + self._free_ranges[i][1])
            del self._free_ranges[i]

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) of the simulated device."""
        return self.capacity - self.used, self.capacity

    # --- streams ---
    def current_stream(self) -> int:
        """The stream selected with :meth:`use_stream` (0 by default)."""
        return self._stream

    @contextlib.contextmanager
    def use_stream(self, stream: int) -> Iterator[int]:
        """Make ``stream`` current inside the block (like ``with cupy.cuda.Stream():``)."""
        prev, self._stream = self._stream, stream
        try:
            yield stream
        finally:
            self._stream = prev

    def enqueue(self, stream: int, n: int = 1) -> None:
        """Queue ``n`` units of simulated work on ``stream``; they complete at ``synchronize``."""
        self._submitted[stream] = self._submitted.get(stream, 0) + n

    def synchronize(self, stream: int | None = None) -> None:
        """Complete all queued work on ``stream`` (all streams when None)."""
        streams = list(self._submitted) if stream is None else [stream]
        for s in streams:
            self._completed[s] = self._submitted.get(s, 0)

    def begin_capture(self, stream: int) -> None:
        """Mark ``stream`` as capturing (tests of graph-capture rules)."""
        self._capturing.add(stream)

    def end_capture(self, stream: int) -> None:
        """End the simulated capture on ``stream``."""
        self._capturing.discard(stream)

    def is_capturing(self, stream: int) -> bool:
        """True between :meth:`begin_capture` and :meth:`end_capture`."""
        return stream in self._capturing

    # --- events ---
    def event_create(self) -> int:
        """New event handle."""
        ev = self._next_event
        self._next_event += 1
        self._events[ev] = None
        self.events_created += 1
        return ev

    def event_record(self, event: int, stream: int) -> None:
        """The event completes once the work queued on ``stream`` so far completes."""
        self._check_event(event)
        self._events[event] = (stream, self._submitted.get(stream, 0))

    def event_query(self, event: int) -> bool:
        """True if the recorded work has completed (an unrecorded event counts as complete, like CUDA)."""
        self._check_event(event)
        rec = self._events[event]
        if rec is None:
            return True
        stream, mark = rec
        return self._completed.get(stream, 0) >= mark

    def event_synchronize(self, event: int) -> None:
        """Complete the stream the event was recorded on."""
        self._check_event(event)
        rec = self._events[event]
        if rec is not None:
            stream, mark = rec
            self._completed[stream] = max(self._completed.get(stream, 0), mark)

    def event_destroy(self, event: int) -> None:
        """Forget an event handle."""
        self._check_event(event)
        del self._events[event]

    def _check_event(self, event: int) -> None:
        if event not in self._events:
            raise ValueError(f"FakeDeviceBackend: unknown event handle {event}")
