"""`bulkgen watch`: JSONL files dropped under a prefix (a folder or an S3 bucket) run as batches."""
