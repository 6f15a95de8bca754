"""Running a server on this machine from Python: in a thread of this process (tests, the
Python API) or as a `serve` subprocess (load tests, SIGTERM tests); always on loopback."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Until GET /health answers 200; raises if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before ready")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{base_url} was not ready after {timeout_s:.0f} s")


class ThreadServer:
    """uvicorn serving `app` on 127.0.0.1 in a daemon thread; `with` stops it."""

    def __init__(self, app, port: int | None = None):
        import uvicorn  # lazy: start-up (tools.bench_serve imports this module)

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, lifespan="off", log_level="warning"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> "ThreadServer":
        self._thread.start()
        wait_ready(self.url, 60)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
