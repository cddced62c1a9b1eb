"""Tests of the accelerators: HPU through the Gaudi test double in tests/fakes, and CUDA streams (skipped without a
GPU)."""
