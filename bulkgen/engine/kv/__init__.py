"""The paged KV cache: blocks, reference counts and prefix caching by chained block hashes
(block_manager), what one layer's cache stores (kv_cache), and how layers share block tables (kv_layout).
Pure bookkeeping and storage: nothing here knows a request, a feature or a rank."""
