"""kvserve's inference engine: a Llama-family model on a paged, ownership-guarded KV cache.

This package never imports Django: Celery tasks and Django services call into it.
"""
