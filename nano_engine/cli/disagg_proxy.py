"""`python -m nano_engine disagg-proxy --prefill URL --decode URL`: the front of disaggregated
serving (serving/disagg_proxy.py), on 127.0.0.1 unless told otherwise; stops on Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse

from .common import guarded

PROG = "python -m nano_engine disagg-proxy"


def _url(text: str) -> str:
    if not text.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{text!r} is not an http(s) URL")
    return text.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    from .serve import _port

    ap = argparse.ArgumentParser(prog=PROG, description=__doc__)
    ap.add_argument("--prefill", type=_url, required=True, help="the prefill server (kv_producer), e.g. "
                                                                 "http://127.0.0.1:8100")
    ap.add_argument("--decode", type=_url, required=True, help="the decode server (kv_consumer)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=_port, default=8000)
    ap.add_argument("--debug", action="store_true", help="print the traceback of a failure")
    return ap


def main(argv=None) -> int:
    def run(ap, args) -> int:
        import uvicorn

        from ..serving.disagg_proxy import build_proxy

        uvicorn.run(build_proxy(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning")
        return 0

    return guarded(build_parser(), argv, run)
