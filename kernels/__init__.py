"""Device ops: torch reference ops everywhere, Triton/CuPy kernels on NVIDIA GPUs."""
