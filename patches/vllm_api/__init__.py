"""vLLM changes the stock speculators 0.3.x generator and worker trip on: API deltas (``v1`` ..
``v7``) and changed defaults that make its results wrong (chunked prefill, prefix caching, Model
Runner V2)."""
