"""An S3 endpoint on loopback for tests and benchmarks: moto's server, started and reached."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import Any

from tensorturn.pool.embedded import free_port

# moto accepts any credentials; these name no real account
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


def start_moto(log: Any = subprocess.DEVNULL, timeout: float = 30) -> tuple[subprocess.Popen, dict[str, str]]:
    """moto's S3 server on a free loopback port, in its own process group (stop it with
    ``tensorturn.pool.embedded.stop_process_group``): the process, and the ``AWS_*`` environment
    a client needs to reach it. Raises ``RuntimeError`` if it does not listen within ``timeout``."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)
    return proc, {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", **CREDENTIALS}
