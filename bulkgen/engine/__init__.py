"""bulkgen.engine: continuous batching, packed varlen prompts and a paged KV cache over HF models."""

from .engine import Engine
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["CompletionOutput", "Engine", "RequestMetrics", "RequestOutput", "SamplingParams"]
