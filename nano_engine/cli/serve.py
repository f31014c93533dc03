"""`python -m nano_engine serve`: the OpenAI-compatible server on one model, with vLLM's flag names.

    python -m nano_engine serve --port 8000 --max-num-batched-tokens 128 --no-enable-prefix-caching

The engine flags are spelled as `vllm serve` spells them (`vllm/engine/arg_utils.py`, EngineArgs),
so a command line moves between the two; `--num-gpu-blocks-override` (vLLM's name) sets the number
of KV blocks here too (there is no GPU: the pool is in CPU memory). It listens on 127.0.0.1 unless
told otherwise, and stops on Ctrl-C or SIGTERM after the step in flight.
"""

from __future__ import annotations

import argparse
import json
import ipaddress
import logging
import os
import pathlib
import signal
import socket
import sys

from .common import add_quantization, check_quantization, guarded, positive_int, thread_count

PROG = "python -m nano_engine serve"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0-65535; 0 = any free port)")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """serve's flags, with the model also taken as vLLM's positional MODEL (`vllm serve MODEL`)."""

    def parse_known_args(self, args=None, namespace=None):
        ns, rest = super().parse_known_args(args, namespace)
        if getattr(ns, "model_tag", None) is not None:
            if ns.model is not None and ns.model != ns.model_tag:
                self.error(f"the model is given twice: {ns.model_tag} and --model {ns.model}")
            ns.model = ns.model_tag
        return ns, rest


def build_parser() -> argparse.ArgumentParser:
    from ..models.loading import DTYPES
    from ..paged import CacheConfig
    from ..scheduler import POLICIES, SchedulerConfig

    d, c = SchedulerConfig(), CacheConfig()
    ap = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as `vllm serve MODEL` takes it "
                                                                 "(the same as --model)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=_port, default=8000, help="port (default 8000; 0 = any free port)")
    ap.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or None,
                    help="ask every /v1 request for `Authorization: Bearer KEY` (401 otherwise; /health, "
                         "/metrics, /version, /tokenize, /detokenize stay open), as vLLM does (default: "
                         "$VLLM_API_KEY, else none)")
    ap.add_argument("--model", help="a Hugging Face folder or a .gguf file (default: $NANO_ENGINE_MODEL, "
                                    "else the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--served-model-name", help="the model name clients send (default: the model's name)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--prepack", action="store_true",
                    help="pack the matmul weights once at load time, as vLLM does on CPU: float32 for "
                         "our AVX-512 kernel (else oneDNN), bfloat16 for our AMX kernel where the CPU has "
                         "AMX, else for our AVX512_BF16 one (faster; a second copy of the weights; Transformer.prepack)")
    ap.add_argument("--attention-backend", choices=["auto", "torch", "c"], default="auto",
                    help="c: one C++ kernel call per layer reads the paged KV blocks in place, built on "
                         "first use (float32 and bfloat16; nano_engine/kernels/paged_attention.py); torch: "
                         "the chapters' PyTorch attention; auto (default): c where it runs the dtype and "
                         "builds, else torch")
    ap.add_argument("--max-model-len", type=positive_int, default=None,
                    help="the longest prompt + output a request may have, as vLLM's (default: the model's "
                         "context, or what the KV cache holds for one request if that is less)")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=d.max_num_batched_tokens,
                    help=f"the token budget of one step (default {d.max_num_batched_tokens})")
    ap.add_argument("--max-num-seqs", type=positive_int, default=d.max_num_seqs,
                    help=f"requests running at once (default {d.max_num_seqs})")
    ap.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                    help="split long prompts across steps (default: on, but for --scheduling-policy static)")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                    default=c.enable_prefix_caching)
    ap.add_argument("--block-size", type=positive_int, default=c.block_size)
    ap.add_argument("--num-gpu-blocks-override", "--num-kv-blocks", dest="num_blocks", type=positive_int,
                    default=c.num_blocks, help=f"KV cache blocks (default {c.num_blocks}; vLLM's name)")
    ap.add_argument("--scheduling-policy", choices=POLICIES, default="fcfs",
                    help="fcfs or priority as in vLLM (lower priority value first); also conservative "
                         "(SGLang's admission) and static")
    ap.add_argument("--scheduler-reserve-full-isl", action=argparse.BooleanOptionalAction,
                    default=d.scheduler_reserve_full_isl,
                    help="admit a request only when blocks for its whole prompt are free (vLLM's default; "
                         "off by default here: the classic rule, where the first chunk is enough)")
    ap.add_argument("--speculative-config", type=_json_object, default=None,
                    help='speculative decoding, as vLLM\'s: JSON such as \'{"method": "ngram", '
                         '"num_speculative_tokens": 3, "prompt_lookup_max": 4}\', or a draft model\'s, '
                         '\'{"model": "/path/to/draft", "num_speculative_tokens": 3}\' (default: off)')
    ap.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                    help="processes the model is cut between, each with its share of the cores "
                         "(default 1; at most the model's KV heads)")
    ap.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1,
                    help="processes the model's layers are cut between, in stages (default 1; not with "
                         "--tensor-parallel-size above 1)")
    ap.add_argument("--kv-transfer-config", type=_json_object, default=None,
                    help="disaggregated prefill (vLLM's JSON): e.g. '{\"kv_role\": \"kv_producer\", "
                         "\"kv_connector_extra_config\": {\"shared_storage_path\": \"/tmp/kv\"}}' on the prefill "
                         "server, kv_consumer on the decode server")
    add_quantization(ap)
    ap.add_argument("--threads", type=thread_count, help="torch threads (default: torch's choice)")
    ap.add_argument("--uvicorn-log-level", default="info",
                    choices=["critical", "error", "warning", "info", "debug", "trace"])
    ap.add_argument("--debug", action="store_true", help="print the traceback of a failure")
    return ap


def engine_config(args) -> "EngineConfig":
    """The EngineConfig of serve's flags (ValueError names a bad value)."""
    from ..engine import EngineConfig

    return EngineConfig.from_settings(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        enable_chunked_prefill=args.enable_chunked_prefill, policy=args.scheduling_policy,
        scheduler_reserve_full_isl=args.scheduler_reserve_full_isl, block_size=args.block_size,
        num_blocks=args.num_blocks, enable_prefix_caching=args.enable_prefix_caching,
        attention_backend=args.attention_backend, speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
        kv_transfer_config=args.kv_transfer_config)


def served_name(args) -> str:
    """--served-model-name, else the model's folder name or its GGUF file's name without .gguf, for
    --model or else $NANO_ENGINE_MODEL ("." is the folder it stands for); the embedded model's otherwise."""
    if args.served_model_name:
        return args.served_model_name
    given = args.model or os.environ.get("NANO_ENGINE_MODEL")
    if not given:
        return EMBEDDED_NAME
    path = pathlib.Path(os.path.abspath(pathlib.Path(given).expanduser()))
    return path.stem if path.suffix == ".gguf" else path.name or str(path)


def run(ap: argparse.ArgumentParser, args) -> int:
    import torch

    from ..kernels.linear import NEEDS, can_prepack
    from ..models.loading import DTYPES

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = engine_config(args)
    except ValueError as e:
        ap.error(str(e))
    check_quantization(ap, args)
    if args.prepack and not can_prepack(DTYPES[args.dtype]):
        ap.error(f"--prepack has no kernel for --dtype {args.dtype} on this machine ({NEEDS})")
    if args.attention_backend == "c":
        from ..kernels import paged_attention as kernels

        if DTYPES[args.dtype] not in kernels.DTYPES:
            ap.error(f"--attention-backend c runs float32 and bfloat16, got --dtype {args.dtype}")
        kernels.build()  # before the model loads: a missing compiler fails in a second, by name
    sock = bind(ap, args.host, args.port)  # before the model loads, as vLLM's setup_server does
    try:
        return _serve(ap, args, config, sock)
    finally:
        sock.close()


def _serve(ap: argparse.ArgumentParser, args, config, sock: socket.socket) -> int:
    """Load the model (in the engine thread) and serve on `sock` until Ctrl-C or SIGTERM."""
    import uvicorn

    from ..engine import LLMEngine
    from ..mini_llm import Transformer
    from ..models.loading import check_model, load_tokenizer
    from ..serving.async_llm import AsyncLLM
    from ..serving.server import build_app

    path = check_model(args.model)

    def make_engine() -> LLMEngine:  # run in the engine thread: it alone runs torch (AsyncLLM)
        model = Transformer.from_pretrained(path, dtype=args.dtype, prepack=args.prepack)
        if args.quantization:
            model.quantize(args.quantization)
        return LLMEngine(model, load_tokenizer(path), config)

    llm = AsyncLLM(make_engine)
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again: end with status 0 then.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    if args.api_key is None and not is_loopback(args.host):
        print(f"warning: listening on {args.host} without --api-key: anyone who can reach this address can "
              f"use the server", file=sys.stderr, flush=True)
    try:
        try:
            app = build_app(llm, served_name(args), args.api_key, args.max_model_len)
        except ValueError as e:  # --max-model-len above the model's or the cache's
            ap.error(str(e).replace("max_model_len=", "--max-model-len ", 1))
        server = _server_class()(uvicorn.Config(app, host=args.host, port=args.port,
                                                log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5))
        server.run(sockets=[sock])
    finally:
        llm.shutdown()
    return 0


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server on a socket bound beforehand: it says where it listens, in uvicorn's words
        (which it leaves out for a socket it did not bind; ServerProcess reads the port from them)."""

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started and sockets:
                host, port = sockets[0].getsockname()[:2]
                logging.getLogger("uvicorn.error").info(
                    "Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                    f"[{host}]" if ":" in host else host, port)

    return Server


def bind(ap: argparse.ArgumentParser, host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything loads: a port in use or a host that is not an address
    of this machine is one line in a second, not an error from uvicorn after the model has loaded."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds its own
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        ap.error(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})")
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    """Whether `host` (an --host value) listens on this machine's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def _exit_cleanly(signum, frame):
    raise SystemExit(0)


def main(argv=None) -> int:
    ap = build_parser()
    return guarded(ap, argv, run)
