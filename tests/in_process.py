"""A server in the test's own process: uvicorn in a thread on 127.0.0.1 (a free port), so that a
test can look inside the app it serves; stopped by whoever started it, whatever happens."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn


@contextlib.contextmanager
def serving(app, **config):
    """Serve `app` (uvicorn.Config keywords in `config`); yields its base URL; stops it on the way out."""
    sock = socket.create_server(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not srv.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(30)
        sock.close()
    assert not thread.is_alive()
