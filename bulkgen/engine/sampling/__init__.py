"""From logits to tokens: per-request settings checked at the edge (sampling_params), penalties and
logit_bias (penalties), counter-based random numbers (counter_rng), the sampler's one tensor pass
(sampler) and when a sequence stops (stopping)."""
