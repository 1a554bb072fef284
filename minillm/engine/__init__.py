"""The serving engine: paged KV blocks (chapter 05), prefix caching (06), continuous batching (07)."""

from .block_manager import BlockManager
from .config import EngineConfig
from .llm_engine import LLMEngine, RequestMetrics, SequenceGroup
from .prefix_cache import HashPrefixCache, PrefixCache, RadixPrefixCache, make_prefix_cache
from .scheduler import Scheduler, SchedulerOutput

__all__ = ["BlockManager", "EngineConfig", "HashPrefixCache", "LLMEngine", "PrefixCache",
           "RadixPrefixCache", "RequestMetrics", "Scheduler", "SchedulerOutput", "SequenceGroup",
           "make_prefix_cache"]
