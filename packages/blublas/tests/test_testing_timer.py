"""blublas.testing.time_ms (the GPU checks' shared timer) on a fake CUDA event clock."""

from blublas.testing import time_ms


class _Clock:
    """Fake cupy: every call of the timed function advances the clock by 2 ms; events read the clock."""

    def __init__(self):
        self.now = 0.0
        clock = self

        class Event:
            def record(self):
                self.t = clock.now

            def synchronize(self):
                pass

        class cuda:  # noqa: N801
            pass

        cuda.Event = Event
        cuda.get_elapsed_time = staticmethod(lambda a, b: b.t - a.t)
        self.cuda = cuda


def test_time_ms_mean_and_repetitions():
    cp = _Clock()
    calls = []

    def fn():
        calls.append(1)
        cp.now += 2.0

    assert time_ms(cp, fn, warmup=2, target_ms=20.0) == 2.0
    assert len(calls) == 2 + 1 + 10  # warm-up, the probe call, target / one call
    calls.clear()
    assert time_ms(cp, fn, warmup=0, target_ms=20.0, max_reps=4) == 2.0
    assert len(calls) == 1 + 4
    calls.clear()
    assert time_ms(cp, fn, warmup=0, target_ms=1.0, min_reps=5) == 2.0
    assert len(calls) == 1 + 5
