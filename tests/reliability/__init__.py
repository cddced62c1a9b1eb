"""Tests of what happens when things go wrong: faults, timeouts, shutdown, a long soak, uneven batches, bad and
untrusted input."""
