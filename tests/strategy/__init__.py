"""Tests of the Lightning strategy: Trainer runs against one device, options and precision flags, registration, the
CLI, launchers (torchrun, SLURM, mpirun, notebooks), compile, monitoring and user patterns."""
