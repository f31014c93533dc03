"""Disaggregated against co-located serving, when long prompts arrive among decodes (issue 42; the
budget trade-off of chapter 4 seen from the other side).

    .venv/bin/python bench/disagg.py                      # about 5 minutes on 2 cores
    .venv/bin/python bench/disagg.py --rounds 1 --decodes 8 --long 2

Co-located: one server with every core. Disaggregated: a prefill server and a decode server with a
core each (the KV moves through a folder, kv_transfer.py), and the proxy in front
(serving/disagg_proxy.py). The load: `--decodes` requests with short prompts and long outputs (the
decodes), and `--long` requests with long prompts and short outputs arriving among them, all at
once (Poisson arrivals at `--rate`). Reports TTFT and TPOT of each kind, medians over the rounds
(configs interleaved, the order turned each round), with the range. Every server listens on
127.0.0.1 and is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from nano_engine.benchmarks.datasets import random_requests  # noqa: E402
from nano_engine.benchmarks.serve import benchmark  # noqa: E402
from nano_engine.models.loading import load_tokenizer  # noqa: E402
from nano_engine.serving.launcher import ServerProcess  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    """`python -m nano_engine disagg-proxy` as a child on 127.0.0.1."""

    def __init__(self, prefill: str, decode: str):
        self.port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "nano_engine", "disagg-proxy", "--prefill", prefill,
                                      "--decode", decode, "--port", str(self.port)])
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("the proxy did not start")
            time.sleep(0.2)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decodes", type=int, default=16, help="requests of 64 prompt tokens, 96 output tokens")
    ap.add_argument("--long", type=int, default=4, help="requests of 1,536 prompt tokens, 8 output tokens")
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", help="write every run's figures here (JSON)")
    args = ap.parse_args(argv)

    tok = load_tokenizer(None)
    short = random_requests(tok, args.decodes, input_len=64, output_len=96, seed=1)
    long = random_requests(tok, args.long, input_len=1536, output_len=8, seed=2)
    requests = short + long
    random.Random(0).shuffle(requests)  # the long prompts arrive among the decodes
    kinds = ["long" if r.prompt_len > 1000 else "decode" for r in requests]
    common = ["--dtype", args.dtype, "--prepack", "--max-num-batched-tokens", "512", "--num-gpu-blocks-override",
              "1024", "--no-enable-prefix-caching"]
    folder = tempfile.mkdtemp(prefix="nano_engine_kv_")

    def kv(role):
        return json.dumps({"kv_role": role, "kv_connector_extra_config": {"shared_storage_path": folder}})

    colocated = ServerProcess(*common, "--threads", "2").start()
    prefill = ServerProcess(*common, "--threads", "1", "--kv-transfer-config", kv("kv_producer")).start()
    decode = ServerProcess(*common, "--threads", "1", "--kv-transfer-config", kv("kv_consumer")).start()
    proxy = Proxy(prefill.url, decode.url)
    runs = {"co-located (1 server, 2 cores)": [], "disaggregated (prefill 1 core + decode 1 core)": []}
    urls = dict(zip(runs, (colocated.url, proxy.url)))
    try:
        for r in range(args.rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                out = benchmark(requests, urls[name], request_rate=args.rate, ignore_eos=True, seed=r,
                                disable_tqdm=True)
                assert not any(out["errors"]), out["errors"]
                per = {}
                for kind in ("decode", "long"):
                    idx = [i for i, k in enumerate(kinds) if k == kind]
                    ttft = [out["ttfts"][i] * 1000 for i in idx]
                    tpot = [1000 * (out["latencies"][i] - out["ttfts"][i]) / (out["output_lens"][i] - 1) for i in idx]
                    per[kind] = {"ttft_ms": statistics.median(ttft), "tpot_ms": statistics.median(tpot)}
                per["duration_s"] = out["duration"]
                runs[name].append(per)
                print(f"round {r + 1} {name}: {json.dumps(per)}", flush=True)
    finally:
        proxy.stop()
        for s in (colocated, prefill, decode):
            s.stop()
    print(f"\n{len(short)} decodes (64 -> 96 tokens) and {len(long)} long prompts (1,536 -> 8) at {args.rate} "
          f"requests/s, {args.dtype}, medians over {args.rounds} rounds (range)\n")
    print("| serving | decode TTFT ms | decode TPOT ms | long TTFT ms | long TPOT ms | duration s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, rs in runs.items():
        def cell(get):
            vals = [get(x) for x in rs]
            return f"{statistics.median(vals):.0f} ({min(vals):.0f}-{max(vals):.0f})"
        print(f"| {name} | {cell(lambda x: x['decode']['ttft_ms'])} | {cell(lambda x: x['decode']['tpot_ms'])} | "
              f"{cell(lambda x: x['long']['ttft_ms'])} | {cell(lambda x: x['long']['tpot_ms'])} | "
              f"{cell(lambda x: x['duration_s'])} |")
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
