"""Execution on Ray: engine worker actors (one per GPU, CPU actors without one) and per-batch runners."""
