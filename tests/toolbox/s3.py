"""A real S3-compatible server on 127.0.0.1 for the object-storage tests: moto's ``moto_server`` (PyPI
``moto[server]``), started in a session of its own on a free port and killed afterwards. Clients reach it through
s3fs with the environment of :attr:`S3Server.env` (any credentials; ``AWS_ENDPOINT_URL`` names the server), which
the launched scripts inherit: no network beyond loopback.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.ranks import clean_env, free_port, kill_group
from tests.toolbox.launch import start_logged

BUCKET = "ckpt"


@dataclass
class S3Server:
    """A running server: its endpoint, the environment a client needs, and the bucket created on it."""

    endpoint: str
    env: dict[str, str]
    bucket: str = BUCKET

    def url(self, *names: str) -> str:
        return "/".join([f"s3://{self.bucket}", *names])

    def filesystem(self):  # an s3fs.S3FileSystem (untyped package) talking to this server, listings never cached
        import s3fs

        return s3fs.S3FileSystem(
            key="test", secret="test", endpoint_url=self.endpoint, skip_instance_cache=True, use_listings_cache=False
        )


def _moto_server() -> str:
    found = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
    if found is None:
        pytest.skip("moto_server (pip install 'moto[server]', in the test extra) is not installed")
    try:
        import s3fs  # noqa: F401
    except ImportError:
        pytest.skip("s3fs (pip install s3fs, in the test extra) is not installed")
    return found


@contextlib.contextmanager
def s3_server(log: Path, timeout: float = 60.0) -> Iterator[S3Server]:
    """Start ``moto_server`` on a free port of 127.0.0.1 (its output in ``log``), create the bucket, and stop it
    afterwards. Skips the test, saying why, only if moto or s3fs is not installed."""
    server = _moto_server()
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    env = clean_env(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_DEFAULT_REGION="us-east-1",
        NO_PROXY="127.0.0.1,localhost",
    )
    proc = start_logged([server, "-H", "127.0.0.1", "-p", str(port)], log, env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"moto_server did not start:\n{log.read_text()[-3000:]}") from None
                time.sleep(0.2)
        s3 = S3Server(endpoint, env)
        s3.filesystem().mkdir(BUCKET)
        yield s3
    finally:
        kill_group(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@contextlib.contextmanager
def client_env(server: S3Server) -> Iterator[None]:
    """This process's environment pointed at ``server`` (for calls made in the test process itself)."""
    keys = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "NO_PROXY")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: server.env[k] for k in keys})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
