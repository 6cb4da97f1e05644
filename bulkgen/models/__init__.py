"""Model resolution: served-model names to local or object-store paths, and tiny test models."""
