"""Tiny local models for the demo, the tests and the benchmarks (not used by the library).

:mod:`speculators_compat.testing.tiny` builds random-weight checkpoints and their tokenizers in a
folder (no hub access): Llama, Qwen3, DeepSeek-V3 and a Kimi-K2.5-shaped multimodal model (built
by :mod:`.kimi`, whose minimal remote code ships in ``remote_code/kimi_k25/``), and their HF
transformers references (:mod:`.reference`); :mod:`.checkpoint` writes and reads the weights in
the hub's layout.
"""
