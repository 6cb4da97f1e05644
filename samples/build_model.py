"""Rebuild the bundled sample model (samples/model): a tiny random-weight Llama with a byte-level tokenizer.

It exists so the quickstart runs offline on any machine; its text is noise. Serve a real model with
`--model NAME=PATH` (any Hugging Face decoder-only folder).
    python samples/build_model.py
"""

from pathlib import Path

from bulkgen.models.tiny import build_tiny_model

if __name__ == "__main__":
    out = build_tiny_model(Path(__file__).parent / "model", arch="llama", seed=1234, hidden_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
                           max_position_embeddings=4096)
    print(f"wrote {out}")
