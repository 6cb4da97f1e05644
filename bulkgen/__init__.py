"""bulkgen: offline bulk LLM generation on your own GPUs behind an OpenAI-compatible batch API."""

__version__ = "0.1.0"
