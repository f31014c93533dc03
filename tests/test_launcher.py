"""launcher.ServerProcess against a stand-in for `python -m nano_engine serve`: fast and in-process.

The stand-in (FAKE_SERVE below) is a small HTTP server that prints uvicorn's start-up line, answers
/health and /metrics, and misbehaves on request (FAKE_MODE): exits at once, never starts, answers
/health 503 at first, ignores SIGTERM. ServerProcess is pointed at it by replacing sys.executable
with a script that runs the stand-in with ServerProcess' own arguments, so these tests check the
command line, the wait, the errors and the stop without loading a model. test_server.py starts the
real server the same way.
"""

import json
import os
import signal
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from nano_engine.serving import launcher
from nano_engine.serving.launcher import ServerProcess

FAKE_SERVE = textwrap.dedent('''
    import ctypes, http.server, json, os, signal, sys, threading
    mode = os.environ.get("FAKE_MODE", "")
    sig = ctypes.c_int(-1)
    ctypes.CDLL("libc.so.6").prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
    print("argv " + json.dumps(sys.argv[1:]), flush=True)
    print("pdeathsig %d env %s" % (sig.value, os.environ.get("FAKE_TAG")), flush=True)
    if mode == "bytes":  # UTF-8 text, then a byte that is not UTF-8 at all
        sys.stdout.buffer.write(b"caf\\xc3\\xa9 \\xff\\n")
        sys.stdout.flush()
    if mode == "exit":
        print("x" * 2500 + "the end", flush=True)
        sys.exit(3)
    if mode == "silent":
        print("y" * 2500 + "waiting", flush=True)
        signal.pause()
    health = {"left": int(os.environ.get("FAKE_503", "0")), "hits": 0}
    METRICS = os.environ.get("FAKE_METRICS", "")

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                health["hits"] += 1
                code = 503 if health["left"] > 0 else 200
                health["left"] -= 1
                body = str(health["hits"]).encode()
            else:
                code, body = 200, METRICS.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), H)
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *a: threading.Thread(target=httpd.shutdown).start())
    print("INFO:     Uvicorn running on http://0.0.0.0:1 (not this one)", flush=True)
    print("INFO:     Uvicorn running on http://127.0.0.1:%d (Press CTRL+C to quit)" % httpd.server_address[1],
          flush=True)
    httpd.serve_forever()
    print("stopped cleanly", flush=True)
''')


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """sys.executable becomes a script that runs FAKE_SERVE with whatever arguments it is given."""
    (tmp_path / "fake_serve.py").write_text(FAKE_SERVE)
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "fake_serve.py"}" "$@"\n')
    exe.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(exe))
    started = []
    real_start = ServerProcess.start

    def start(self):
        started.append(self)
        return real_start(self)
    monkeypatch.setattr(ServerProcess, "start", start)
    yield started
    for server in started:  # whatever a test left running
        server.stop(timeout=5)


def line(server, prefix):
    return next(x[len(prefix):] for x in server.log_text().splitlines() if x.startswith(prefix))


@pytest.mark.parametrize("flags", [("--host", "0.0.0.0"), ("--port=8000",), ("--max-num-seqs", "2", "--port", "1")])
def test_host_and_port_are_its_own_choice(flags):
    with pytest.raises(ValueError, match="--host.*--port"):
        ServerProcess(*flags)


def test_start_runs_serve_on_loopback_and_a_free_port_and_waits_for_health(fake, monkeypatch):
    monkeypatch.setenv("FAKE_TAG", "from the parent")
    server = ServerProcess("--max-num-seqs", 2, env={"FAKE_503": "2", "FAKE_TAG": "t"})
    assert (server.proc, server.port, server.log_text(), server.stop()) == (None, None, "", None)  # not started yet
    assert server.env == {**os.environ, "FAKE_503": "2", "FAKE_TAG": "t"}  # the parent's environment, then env
    assert server.start() is server
    assert json.loads(line(server, "argv ")) == ["-m", "nano_engine", "serve", "--host", "127.0.0.1", "--port", "0",
                                                 "--max-num-seqs", "2"]
    assert line(server, "pdeathsig ") == f"{signal.SIGTERM.value} env t"  # dies with its parent; env passed
    assert server.port != 1 and server.base_url == f"http://127.0.0.1:{server.port}/v1"  # an OpenAI client's
    assert httpx.get(f"{server.url}/health").text == "4"  # 503, 503, 200 before start returned
    with pytest.raises(RuntimeError, match="started"):
        server.start()
    proc, log = server.proc, server._log.name
    assert server.stop() == 0 and proc.returncode == 0  # SIGTERM, then a clean exit
    assert server.proc is None and not os.path.exists(log) and server.stop() is None  # no log left behind
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")


def test_only_linux_children_get_a_parent_death_signal(fake, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(sys, "platform", "darwin")  # prctl is Linux's: elsewhere the child is started plainly
        server = ServerProcess().start()
    assert line(server, "pdeathsig ") == "0 env None" and server.stop() == 0


def test_the_log_reads_as_utf8_whatever_the_locale_and_a_bad_byte_does_not_stop_it(fake):
    import locale

    server = ServerProcess(env={"FAKE_MODE": "bytes"}).start()
    saved = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")  # an ASCII locale: open() without an encoding would mangle "é"
    try:
        text = server.log_text()
    finally:
        locale.setlocale(locale.LC_CTYPE, saved)
    assert "\ncaf\u00e9 \ufffd\n" in text and server.stop() == 0


def test_metrics_sums_each_name_over_its_labels(fake):
    text = ('# HELP vllm:request_success_total Finished requests.\n# TYPE vllm:request_success_total counter\n'
            'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0\n'
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0\n'
            'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0\n'
            'process_open_fds 7\n'
            'Upper_Case:name 1.5e3\n'
            'not a metric line\n')
    with ServerProcess(env={"FAKE_METRICS": text}) as server:
        assert server.metrics() == {"vllm:request_success_total": 5.0, "vllm:e2e_request_latency_seconds_bucket": 4.0,
                                    "process_open_fds": 7.0, "Upper_Case:name": 1500.0}


def test_with_block_starts_once_and_stops(fake):
    server = ServerProcess()
    with server as s:
        assert s is server and server.proc.poll() is None
        proc = server.proc
        with server as again:  # already started: the same child, not a second one
            assert again is server and server.proc is proc
        assert server.proc is None  # the inner block's exit stopped it
    assert proc.returncode == 0 and len(fake) == 1


@pytest.mark.parametrize("mode, error, tail", [("exit", "exited with status 3", "the end"),
                                              ("silent", "did not start in 1 s", "waiting")])
def test_a_child_that_exits_or_never_starts_is_reported_with_its_log_tail_and_stopped(fake, mode, error, tail):
    server = ServerProcess(timeout=1.4, env={"FAKE_MODE": mode})
    t0 = time.monotonic()
    with pytest.raises((RuntimeError, TimeoutError), match=error) as e:
        server.start()
    assert time.monotonic() - t0 < 30 and str(e.value).endswith(tail + "\n")
    assert len(str(e.value)) < 2500  # the log's tail only
    assert server.proc is None and server not in launcher._LIVE


def test_stop_kills_a_child_that_ignores_sigterm(fake):
    server = ServerProcess(env={"FAKE_MODE": "ignore_term"}).start()
    t0 = time.monotonic()
    assert server.stop(timeout=0.5) == -signal.SIGKILL
    assert 0.5 <= time.monotonic() - t0 < 10


def test_the_interpreters_exit_stops_every_live_server(fake):
    servers = [ServerProcess().start(), ServerProcess().start()]
    procs = [s.proc for s in servers]
    launcher._stop_all()
    assert [p.returncode for p in procs] == [0, 0] and not launcher._LIVE & set(servers)


def test_a_server_started_from_a_short_lived_thread_outlives_it(fake):
    with ThreadPoolExecutor(1) as pool:  # PR_SET_PDEATHSIG follows the forking thread: not this one
        server = pool.submit(ServerProcess().start).result()
    time.sleep(0.5)
    assert server.proc.poll() is None and httpx.get(f"{server.url}/health").status_code == 200
    assert server.stop() == 0
