"""Tests of the benchmark commands (benchmarks/), their workload model (lightning_fsdp.demo) and the GPU check."""
