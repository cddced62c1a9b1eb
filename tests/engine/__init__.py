"""Tests of the sharding engine (lightning_fsdp/engine/) on gloo ranks: parity with one device, its options and
controls, memory, collectives and streams."""
