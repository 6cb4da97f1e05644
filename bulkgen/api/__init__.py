"""The OpenAI-compatible HTTP job service (Files + Batches + Models), stateless over object storage."""

from bulkgen.api.app import create_app

__all__ = ["create_app"]
