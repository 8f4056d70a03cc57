"""bluprofiler: per-op GPU/host timing, allocation tracking, Chrome traces, graph recorder and a
precision logger for BluTrain. Nothing of it is on the op path unless a session is running.

``with bluprofiler.profile() as prof: step()`` then ``prof.result.table()``.
"""

from bluprofiler.__about__ import __version__
from bluprofiler.compare import Adapter, Comparison, compare, gpt2_adapter
from bluprofiler.graph import record_graph, record_shapes, save_graph, to_dot
from bluprofiler.precision import PrecisionLogger, TorchPrecisionLogger, load_dump, save_dump
from bluprofiler.profiler import Profiler, ProfilerError, active, profile, record_function
from bluprofiler.result import ProfileResult
from bluprofiler.run import profile_steps
from bluprofiler.trace import chrome_trace, write_chrome_trace

__all__ = [
    "Adapter", "Comparison", "PrecisionLogger", "ProfileResult", "Profiler", "ProfilerError",
    "TorchPrecisionLogger", "__version__", "active", "chrome_trace", "compare", "gpt2_adapter", "load_dump",
    "profile", "profile_steps", "record_function", "record_graph", "record_shapes", "save_dump", "save_graph",
    "to_dot", "write_chrome_trace",
]
