"""Model resolution (served-model names to local or object-store paths), the bundled default model
(bundled/, trained by jobs/train_tiny.py), tiny random test models, and memory arithmetic."""
