"""nano_engine's server and vLLM's server, both loaded by both clients, at a sweep of Poisson rates.

    .venv/bin/python bench/online.py                  # needs .venv-vllm (make vllm); ~15 minutes
    .venv/bin/python bench/online.py --rates 0.5,1,inf --rounds 1 --num-prompts 8

Starts both servers on 127.0.0.1 with the same settings (nano_engine's flags, and vLLM's command
from `vllm_bridge.vllm_command` for the same EngineConfig; vLLM keeps its CPU block size and
sizes its KV cache from VLLM_CPU_KVCACHE_SPACE), on the same weights (the Hugging Face folder
nano_engine dequantizes the embedded GGUF into). Both stay up; traffic goes to one at a time.
For each round and rate, the four (server, client) pairs take turns in an order that rotates,
so that drift in the machine's speed falls on all of them alike. The clients: our
`python -m nano_engine bench-serve` and vLLM's own `vllm bench serve` (vllm/benchmarks/serve.py,
run from .venv-vllm through a shim: vllm-cpu's console script does not start). Both send the
random dataset (fixed input and output lengths, --ignore-eos) with the same seed, Poisson
arrivals at each rate, bounded in requests, and end by themselves.

Writes bench/online.json (every run's metrics), bench/online.md (the table: medians over the
rounds, with the range) and bench/online.png (TTFT and TPOT against the achieved request rate).
Both servers are stopped at the end, on an error too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nano_engine.engine import EngineConfig  # noqa: E402
from nano_engine.serving.launcher import ServerProcess  # noqa: E402
from nano_engine.models.loading import cache_dir, embedded_model_path, load_checkpoint, load_tokenizer  # noqa: E402
from nano_engine.cli.serve import EMBEDDED_NAME  # noqa: E402
from nano_engine.lab.vllm_bridge import vllm_command  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from client_parity import VLLM_PY, client_command  # noqa: E402
METRICS = ["request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "p99_tpot_ms", "median_itl_ms", "median_e2el_ms"]
SERVERS, CLIENTS = ("nano_engine", "vLLM"), ("nano_engine bench-serve", "vllm bench serve")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """vLLM's OpenAI server from .venv-vllm on 127.0.0.1; stopped by stop() (SIGINT, then SIGKILL)."""

    def __init__(self, config: EngineConfig, folder: pathlib.Path, dtype: str, threads: int, log: pathlib.Path):
        self.port = free_port()
        cmd = vllm_command(config, str(folder), dtype=dtype, max_model_len=4096, port=self.port,
                           served_model_name=EMBEDDED_NAME)
        del cmd[cmd.index("--block-size"):cmd.index("--block-size") + 2]  # vLLM on CPU: its own, 128
        del cmd[cmd.index("--num-gpu-blocks-override"):cmd.index("--num-gpu-blocks-override") + 2]
        self.cmd = [str(VLLM_PY)] + cmd[1:]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
               "VLLM_LOGGING_LEVEL": "WARNING"}
        self.log = log
        self.proc = subprocess.Popen(self.cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 600) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {self.proc.returncode}: "
                                   f"{self.log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise TimeoutError(f"vLLM's server did not answer /health in {timeout:.0f} s; log: {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def client_cmd(client: str, url: str, folder: pathlib.Path, rate: str, a, out: pathlib.Path) -> list[str]:
    return client_command("nano_engine" if client == CLIENTS[0] else "vllm", url, folder, a, rate, out)


def run_client(client, url, folder, rate, a, out: pathlib.Path) -> dict:
    r = subprocess.run(client_cmd(client, url, folder, rate, a, out), cwd=ROOT, capture_output=True, text=True,
                       timeout=a.client_timeout)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{client} against {url} at rate {rate} failed ({r.returncode}): {r.stderr[-1500:]}")
    result = json.loads(out.read_text())
    result = result[0] if isinstance(result, list) else result
    return {k: result.get(k) for k in ["completed", "total_input_tokens", "total_output_tokens", "duration", *METRICS]}


def summarize(runs: list[dict], rates: list[str]) -> list[dict]:
    rows = []
    for rate in rates:
        for server in SERVERS:
            for client in CLIENTS:
                these = [r for r in runs if (r["rate"], r["server"], r["client"]) == (rate, server, client)]
                if not these:
                    continue
                row = dict(rate=rate, server=server, client=client, rounds=len(these),
                           completed=[r["completed"] for r in these])
                for k in METRICS:
                    vals = [r[k] for r in these if r.get(k) is not None]
                    row[k] = dict(median=statistics.median(vals), min=min(vals), max=max(vals)) if vals else None
                rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    fmt = lambda m, d=0: "-" if m is None else (f"{m['median']:.{d}f}" if m["min"] == m["max"] else  # noqa: E731
                                                 f"{m['median']:.{d}f} ({m['min']:.{d}f}-{m['max']:.{d}f})")
    out = ["| rate (req/s) | server | client | req/s achieved | output tok/s | TTFT median ms | TTFT p99 ms "
           "| TPOT median ms | E2E median ms |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['rate']} | {r['server']} | {r['client']} | {fmt(r['request_throughput'], 2)} | "
                   f"{fmt(r['output_throughput'], 1)} | {fmt(r['median_ttft_ms'])} | {fmt(r['p99_ttft_ms'])} | "
                   f"{fmt(r['median_tpot_ms'])} | {fmt(r['median_e2el_ms'])} |")
    return "\n".join(out)


def ratios(rows: list[dict], rates: list[str]) -> list[str]:
    """vLLM's medians over nano_engine's, per rate and client (above 1: nano_engine is ahead)."""
    out = []
    for rate in rates:
        for client in CLIENTS:
            pair = {r["server"]: r for r in rows if r["rate"] == rate and r["client"] == client}
            if len(pair) < 2:
                continue
            n, v = pair["nano_engine"], pair["vLLM"]
            parts = []
            for k, label, higher_better in (("output_throughput", "output tok/s", True),
                                            ("median_ttft_ms", "TTFT", False), ("median_tpot_ms", "TPOT", False)):
                if n[k] and v[k] and n[k]["median"] and v[k]["median"]:
                    r = (n[k]["median"] / v[k]["median"]) if higher_better else (v[k]["median"] / n[k]["median"])
                    parts.append(f"{label} {r:.2f}x")
            out.append(f"rate {rate}, {client}: nano_engine against vLLM (above 1: nano_engine ahead): "
                       + ", ".join(parts))
    return out


def plot(rows: list[dict], path: pathlib.Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for (server, client), style in zip([(s, c) for s in SERVERS for c in CLIENTS], ["o-", "o--", "s-", "s--"]):
        pts = [r for r in rows if r["server"] == server and r["client"] == client and r["request_throughput"]]
        xs = [r["request_throughput"]["median"] for r in pts]
        for ax, key in zip(axes, ("median_ttft_ms", "median_tpot_ms")):
            ax.plot(xs, [r[key]["median"] for r in pts], style, label=f"{server} server, {client}")
    for ax, what in zip(axes, ("median TTFT (ms)", "median TPOT (ms)")):
        ax.set_xlabel("achieved request rate (req/s)")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="0.5,1,2,inf", help="Poisson request rates (req/s); inf = all at once")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="CPUs each server computes on")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-prepack", dest="prepack", action="store_false",
                    help="nano_engine's plain float32 path (default: --prepack, as vLLM packs its weights)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--client-timeout", type=float, default=900)
    ap.add_argument("--out", default=str(ROOT / "bench" / "online"), help="STEM: STEM.json, STEM.md, STEM.png")
    a = ap.parse_args()
    if not VLLM_PY.exists():
        print("bench/online.py: needs .venv-vllm: run `make vllm` first", file=sys.stderr)
        return 2
    rates = a.rates.split(",")
    # OMP_WAIT_POLICY=PASSIVE (the tests' setting: two workers share two cores) puts OpenMP threads to
    # sleep after every operator, and a decode step of many small ones takes twice as long: not here.
    os.environ.pop("OMP_WAIT_POLICY", None)
    gguf = embedded_model_path()
    load_checkpoint(gguf), load_tokenizer(gguf)  # writes the Hugging Face folder both servers load
    folder = cache_dir(gguf)
    config = EngineConfig.from_settings(max_num_batched_tokens=a.max_num_batched_tokens,
                                        max_num_seqs=a.max_num_seqs, num_blocks=2048)
    flags = ["--dtype", a.dtype, "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--max-num-seqs",
             str(a.max_num_seqs), "--num-gpu-blocks-override", "2048", "--threads", str(a.threads),
             "--served-model-name", EMBEDDED_NAME] + (["--prepack"] if a.prepack else [])
    started = datetime.datetime.now(datetime.timezone.utc)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        vllm = VLLMServer(config, folder, a.dtype, a.threads, tmp / "vllm.log")
        try:
            with ServerProcess(*flags) as nano:
                print("nano_engine:", " ".join(flags), flush=True)
                print("vLLM:", " ".join(vllm.cmd[1:]), flush=True)
                t = time.perf_counter()
                vllm.wait()
                print(f"vLLM's server up in {time.perf_counter() - t:.0f} s", flush=True)
                urls = {"nano_engine": nano.url, "vLLM": vllm.url}
                pairs = [(s, c) for s in SERVERS for c in CLIENTS]
                turn = 0
                for rnd in range(a.rounds):
                    for rate in rates:
                        for server, client in pairs[turn % 4:] + pairs[:turn % 4]:
                            out = tmp / f"{len(runs)}.json"
                            t = time.perf_counter()
                            m = run_client(client, urls[server], folder, rate, a, out)
                            runs.append(dict(round=rnd, rate=rate, server=server, client=client, **m))
                            print(f"round {rnd + 1}, rate {rate}: {server} server, {client}: "
                                  f"{m['completed']} done, {m['request_throughput']:.2f} req/s, TTFT median "
                                  f"{m['median_ttft_ms']:.0f} ms, TPOT median {m['median_tpot_ms']:.0f} ms "
                                  f"({time.perf_counter() - t:.0f} s)", flush=True)
                        turn += 1
        finally:
            vllm.stop()
    rows = summarize(runs, rates)
    vllm_version = subprocess.run([str(VLLM_PY), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                  text=True).stdout.strip()
    sys.path.insert(0, str(ROOT / "bench"))
    from run import cpu_name  # the benchmark's CPU line

    where = (f"measured {started:%Y-%m-%d %H:%M} UTC on {cpu_name()}, {os.cpu_count()} cores, each server "
             f"on {a.threads} threads; vLLM {vllm_version} (vllm-cpu), {platform.python_version()}")
    what = (f"{a.num_prompts} random requests per run, {a.input_len} tokens in, {a.output_len} out, seed {a.seed}; "
            f"Poisson arrivals; {a.rounds} rounds, pairs in rotating order; both servers: budget "
            f"{a.max_num_batched_tokens}, {a.max_num_seqs} sequences, chunked prefill, prefix caching, fcfs, "
            f"{a.dtype}{' (nano_engine --prepack)' if a.prepack else ''}; block size 16 (nano_engine), 128 (vLLM CPU)")
    stem = pathlib.Path(a.out)
    summary = ratios(rows, rates)
    stem.with_suffix(".json").write_text(json.dumps(dict(where=where, what=what, settings=vars(a), runs=runs,
                                                         rows=rows, ratios=summary), indent=1))
    md = f"# nano_engine and vLLM online\n\n{where}.\n{what}.\nMedians over the rounds (range).\n\n{table(rows)}\n\n"
    md += "\n".join(f"- {s}" for s in summary) + "\n"
    stem.with_suffix(".md").write_text(md)
    plot(rows, stem.with_suffix(".png"), f"{where}\n{what}")
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
