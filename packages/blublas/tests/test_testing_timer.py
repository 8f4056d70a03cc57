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


def test_gpt2_gemm_shapes_are_the_training_step_table():
    """The 15 GEMMs of a GPT-2 124M training step at B*T = 16384: forward 16384 x 768 times
    768 x {2304, 768, 3072}, 3072 x 768, 768 x 50304, and the matching dX and dW GEMMs (FLOPs of dX and dW
    equal the forward's)."""
    from blublas.testing import gpt2_gemm_shapes

    shapes = gpt2_gemm_shapes()
    assert len(shapes) == 15 and len({s[0] for s in shapes}) == 15
    fwd = {s[0][4:]: s for s in shapes if s[1] == "nt"}
    assert fwd["qkv"] == ("fwd_qkv", "nt", 16384, 2304, 768)
    assert fwd["lm_head"] == ("fwd_lm_head", "nt", 16384, 50304, 768)
    for name, (_, _, m, n, k) in fwd.items():
        dx = next(s for s in shapes if s[0] == f"dx_{name}")
        dw = next(s for s in shapes if s[0] == f"dw_{name}")
        assert dx[1:] == ("nn", m, k, n) and dw[1:] == ("tn", n, k, m)
