"""The batch domain: ids, batch and file records, input validation, request decoding and output lines.

Knows nothing of HTTP, Ray or tensors; everything it persists goes through `bulkgen.store`.
"""
