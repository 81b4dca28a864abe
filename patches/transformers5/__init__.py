"""transformers v5: what ``import speculators`` 0.3.0 needs to work at all (in the driver and in
every vLLM worker)."""
