"""The step features: what changes what a step is for some requests only. LoRA adapters and their
device slots (lora, lora_slots), images (multimodal, image_blocks, image_only, pixtral), what LoRA and
images send tensor-parallel followers each step (lora_plan, image_plan: plan sections the wing carries), hybrid models'
recurrent state (state_slots, hybrid_layers), constrained decoding (grammar, guide, schema_compiler,
reasoning_gate) and pooled embeddings (pooling). Each is built once with the engine behind the seam of
bulkgen.engine.step_features; an absent feature is a no-op object. No module here imports
bulkgen.engine.parallel (the wing imports them)."""
