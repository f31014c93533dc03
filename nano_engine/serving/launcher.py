"""Start `python -m nano_engine serve` as a child process and stop it: for notebooks, tests, benchmarks.

    with ServerProcess("--max-num-seqs", "8") as server:
        client = OpenAI(base_url=server.base_url, api_key="none")
        ...
    # or, across notebook cells: server = ServerProcess(...).start() ... server.stop()

It listens on 127.0.0.1 on a free port (`--port 0`; the port is read from uvicorn's log line), and
whoever starts it stops it: `stop()`, the `with` block, the interpreter's exit (atexit), and, if
the parent dies without any of those, the kernel (Linux's PR_SET_PDEATHSIG sends the child SIGTERM).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

_LIVE: set = set()
# PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the process: children are
# forked from this one long-lived thread, so a server started from a short-lived thread (a thread
# pool's, a notebook's background job) lives until stop() or the interpreter's exit.
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="nano_engine-spawner")


def _die_with_parent() -> None:  # runs in the child, before exec
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ServerProcess:
    """A `python -m nano_engine serve` child on 127.0.0.1 and a free port; `flags` are serve's flags."""

    def __init__(self, *flags: str, timeout: float = 180.0, env: dict | None = None):
        self.flags, self.timeout = [str(f) for f in flags], timeout  # ("--max-num-seqs", 8) is fine
        if any(f in ("--host", "--port") or f.startswith(("--host=", "--port=")) for f in self.flags):
            raise ValueError("ServerProcess chooses --host 127.0.0.1 and a free --port itself")
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self._log = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """What an OpenAI client takes: the /v1 root."""
        return f"{self.url}/v1"

    def log_text(self) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def start(self) -> "ServerProcess":
        if self.proc is not None:
            raise RuntimeError("this server was started already")
        # The child writes to this file's descriptor; log_text() reads it back by name.
        self._log = tempfile.NamedTemporaryFile(prefix="nano_engine_serve_", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "nano_engine", "serve", "--host", "127.0.0.1", "--port", "0", *self.flags]
        self.proc = _SPAWNER.submit(subprocess.Popen, cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                    preexec_fn=_die_with_parent if sys.platform == "linux" else None).result()
        _LIVE.add(self)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.port is None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}:\n{self.log_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start in {self.timeout:.0f} s:\n{self.log_text()[-2000:]}")
            m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", self.log_text())
            if m:
                self.port = int(m.group(1))
            else:
                time.sleep(0.1)
        while httpx.get(f"{self.url}/health", timeout=10).status_code != 200:
            time.sleep(0.1)

    def metrics(self) -> dict[str, float]:
        """GET /metrics as {name: value} (summed over labels; histograms as _sum / _count)."""
        out: dict[str, float] = {}
        for m in re.finditer(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})? (\S+)$", httpx.get(f"{self.url}/metrics").text, re.M):
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` s; returns the exit status (0: it stopped cleanly)."""
        _LIVE.discard(self)
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            os.unlink(self._log.name)
            self._log = None
        return proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(timeout=5)
