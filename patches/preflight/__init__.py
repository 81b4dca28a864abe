"""Preflight checks: the generator refuses before its executor starts and the weights load, when
the installed vLLM line was never validated, an API the stock code uses has an unknown shape, or
a stock call into vLLM would not bind."""
