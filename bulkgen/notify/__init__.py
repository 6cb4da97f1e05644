"""Telling others that a batch has ended (completion webhooks)."""
