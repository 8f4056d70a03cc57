"""Process-group backends: ``local`` (one process), ``mpi`` (mpi4py, CPU) and ``nccl`` (CuPy, GPU)."""
