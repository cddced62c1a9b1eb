"""The test process's environment carries no launcher variables between tests.

A Trainer run inside the test process sets ``MASTER_ADDR`` / ``MASTER_PORT`` in ``os.environ`` (Lightning's
``_init_dist_connection``) and leaves them there. Launches that copy ``os.environ`` would then all ask Lightning's
launcher for that one port, and launches started at once (``tests/toolbox/launch.py in_background``) would meet in each
other's store. So the variables are removed before the session (pytest itself may run under a launcher) and put
back to that clean state after every test.
"""

from __future__ import annotations

import os

import pytest

from benchmarks.ranks import LAUNCHER_VARIABLES


def _drop_launcher_variables() -> None:
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)


_drop_launcher_variables()


@pytest.fixture(autouse=True)
def _no_launcher_variables_left_behind():
    yield
    _drop_launcher_variables()
