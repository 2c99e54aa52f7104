"""The parts of benchmarks/gpu_check.py: correctness checks and benchmarks, each runnable on CUDA or the CPU."""
