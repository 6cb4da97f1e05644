"""What a Llama-shaped model holds in memory: training (weights, gradients, AdamW state) against inference
(weights plus KV cache). Computed from the config alone, so it works for models that are not on disk.

Activations are left out on both sides: they depend on batch, sequence length and checkpointing, and the
point here is the fixed cost: training keeps four copies of every parameter, inference one plus a cache
that grows with every token in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class LlamaShape:
    name: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    head_dim: int | None = None

    @property
    def head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def parameters(self) -> int:
        h, d = self.hidden_size, self.head
        attention = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        mlp = 3 * h * self.intermediate_size
        layers = self.num_hidden_layers * (attention + mlp + 2 * h)
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return layers + embeddings + h

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head * bytes_per_value

    @classmethod
    def from_config(cls, name: str, config) -> LlamaShape:
        return cls(
            name,
            config.vocab_size,
            config.hidden_size,
            config.num_hidden_layers,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.intermediate_size,
            bool(config.tie_word_embeddings),
            getattr(config, "head_dim", None),
        )


# Public shapes of the two reference models (their config.json), for the computed rows.
LLAMA_3_2_1B = LlamaShape("Llama-3.2-1B", 128256, 2048, 16, 32, 8, 8192, True, 64)
LLAMA_3_8B = LlamaShape("Llama-3-8B", 128256, 4096, 32, 32, 8, 14336, False, 128)


@dataclass(frozen=True)
class MemoryRow:
    shape: LlamaShape
    context: int
    batch: int

    @property
    def training_bytes(self) -> int:
        """fp32 weights + fp32 gradients + AdamW's two fp32 moments: 16 bytes per parameter."""
        return 16 * self.shape.parameters

    @property
    def weights_bytes(self) -> int:
        """bf16 weights, as the engine serves on a GPU."""
        return 2 * self.shape.parameters

    @property
    def kv_cache_bytes(self) -> int:
        return self.shape.kv_bytes_per_token() * self.context * self.batch

    @property
    def inference_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes


def format_memory_table(rows: list[MemoryRow]) -> str:
    """A Markdown table; sizes in GiB (MiB below 0.1 GiB)."""

    def size(n: int) -> str:
        return f"{n / GIB:,.1f} GiB" if n >= GIB / 10 else f"{n / 2**20:,.1f} MiB"

    lines = [
        "| model | params | training: weights+grads+AdamW (fp32) | inference: weights (bf16) "
        "| KV cache (bf16) at context x batch | inference total | training / inference |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.shape.name} | {r.shape.parameters / 1e6:,.1f} M | {size(r.training_bytes)} "
            f"| {size(r.weights_bytes)} | {size(r.kv_cache_bytes)} at {r.context:,} x {r.batch} "
            f"| {size(r.inference_bytes)} | {r.training_bytes / r.inference_bytes:.1f}x |"
        )
    return "\n".join(lines)
