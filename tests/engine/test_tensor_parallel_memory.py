"""Host memory of tensor-parallel ranks while loading: each rank reads only its slices of a checkpoint
split into 10 MB safetensors files, so its peak resident set grows by about its share of the weights
(half of a 121 MiB fp32 model), not by the whole model."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bulkgen.engine import Engine
from bulkgen.lab.tiny import build_tokenizer

MIB = 1 << 20


def test_each_rank_peaks_near_its_share_of_the_weights(tmp_path):
    tok = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(tmp_path, max_shard_size="10MB")
    tok.save_pretrained(tmp_path)
    del model
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 10
    largest = max(f.stat().st_size for f in files)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine.from_pretrained(str(tmp_path), device="cpu", tensor_parallel=2, num_kv_blocks=16)
    try:
        memory = engine.runner.tp.rank_memory()
    finally:
        engine.close()
        torch.set_num_threads(threads)
    for rank in memory:
        grown = rank["peak_rss"] - rank["rss_before"]
        assert rank["weight_bytes"] <= full // 2 + 512 * 131 * 4  # half, plus the padded vocabulary row
        # its weights, the file being read (mapped pages a column slice touches) and the modules' setup
        assert grown <= rank["weight_bytes"] + 2 * largest + 16 * MIB, (rank, full)
        assert grown < 0.8 * full, (rank, full)
