"""nano_engine: a teaching LLM inference engine after vLLM V1.

One token budget per step, chunked prefill, recompute preemption, a paged KV cache with prefix
caching, serving a real chat model on a CPU. The names a notebook needs are exported here: the
engine the chapters build, which lives at the top level of the package. Below it, kernels/ and
models/; above it, lab/, serving/, benchmarks/ and cli/ (README.md, "Layout").
"""

from .engine import EngineConfig, LLMEngine, StepRecord
from .mini_llm import ModelConfig, Transformer, generate
from .paged import BlockPool, CacheConfig, PagedKVCache
from .policies import ConservativeScheduler, PriorityScheduler, StaticScheduler, scheduler_class
from .request import Request, RequestStatus, SamplingParams
from .runner import Batch, ModelRunner, SeqChunk, build_batch
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput

__all__ = [
    "Batch", "BlockPool", "CacheConfig", "ConservativeScheduler", "EngineConfig", "LLMEngine", "ModelConfig", "ModelRunner",
    "PagedKVCache", "PriorityScheduler", "Request", "RequestStatus", "SamplingParams", "Scheduler",
    "SchedulerConfig", "SchedulerOutput", "SeqChunk", "StaticScheduler", "StepRecord", "Transformer",
    "build_batch", "generate", "scheduler_class",
]
