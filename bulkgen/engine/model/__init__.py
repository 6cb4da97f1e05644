"""A model on its device: reading a checkpoint (loading, weight_format), checking it is whole before
anything loads (checkpoint_checks), FP8 arithmetic and online quantization (fp8, quantize,
quantize_experts), the load's progress for liveness (load_progress), the tested library releases
(upstream), and the fingerprint of what decides an engine's tokens (fingerprint)."""
