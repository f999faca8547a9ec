"""Serving: an engine with continuous batching over a paged KV cache (:mod:`mff.serve.engine`)
and the OpenAI-compatible HTTP layer over it (:mod:`mff.serve.api`, FastAPI; ``mff[serve]``)."""
