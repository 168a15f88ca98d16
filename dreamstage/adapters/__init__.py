"""Adapters: the GGUF LoRA files a job writes and the served adapter set serving runs with.

- `files`: atomic writes and digests of adapter files;
- `served`: the served adapter, promotion, rollback and the swap between batches.
"""
