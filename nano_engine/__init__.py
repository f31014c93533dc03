"""nano_engine: a teaching LLM inference engine after vLLM V1.

One token budget per step, chunked prefill, recompute preemption, a paged KV cache with prefix
caching, serving a real chat model on a CPU. The names a notebook needs are exported here.
"""

from .async_engine import AsyncLLM, RequestOutput
from .engine import EngineConfig, LLMEngine, StepRecord
from .mini_llm import ModelConfig, Transformer, generate
from .paged import BlockPool, PagedKVCache
from .policies import ConservativeScheduler, PriorityScheduler, StaticScheduler, scheduler_class
from .request import Request, RequestStatus, SamplingParams
from .runner import Batch, ModelRunner, SeqChunk, build_batch
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput

__all__ = [
    "AsyncLLM", "Batch", "BlockPool", "ConservativeScheduler", "EngineConfig", "LLMEngine", "ModelConfig", "ModelRunner",
    "PagedKVCache", "PriorityScheduler", "Request", "RequestOutput", "RequestStatus", "SamplingParams", "Scheduler",
    "SchedulerConfig", "SchedulerOutput", "SeqChunk", "StaticScheduler", "StepRecord", "Transformer",
    "build_batch", "generate", "scheduler_class",
]
