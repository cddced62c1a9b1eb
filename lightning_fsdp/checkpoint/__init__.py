"""Checkpoint state for sharded models: full, sharded and local formats."""
