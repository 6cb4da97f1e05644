"""Tensor parallel: rank 0's group and its followers (tensor_parallel), the step plan sent to them
(plan_codec), how weights split: the parallel layer types (layers: column, row, packed, vocabulary, fused
experts; each reads its checkpoint slices, installs its all-reduce and splits a LoRA adapter on it), the
plans that name a type per module (sharding, shard_base; per family where a transformers plan falls short:
shard_families, shard_packed, shard_mla, shard_hybrid, shard_gptoss; FP8 checkpoints: shard_quantized;
vision-language models: vision_shards), LoRA on a split model (lora_tp), a rank's memory from its config
(rank_memory) and the deadline on replayed collectives (replay_watchdog). It imports the features it
splits; they never import it."""
