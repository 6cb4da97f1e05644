"""Model resolution (served-model names to local or object-store paths) and the bundled default model
(bundled/, trained by jobs/train_tiny.py)."""
