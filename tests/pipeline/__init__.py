"""Tests of pipeline parallelism composed with sharding, and its checkpoints across pipeline layouts."""
