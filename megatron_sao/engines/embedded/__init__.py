"""The embedded engine: a CPU server speaking SGLang's HTTP API over a transformers model.

server.py (HTTP routes) -> generate.py (/generate parsing, responses) -> scheduler.py (continuous batching, token
boundaries) -> model_runner.py (forward, sampling, log-probs) + kv_cache.py (slot KV cache); weights.py applies
in-place weight updates broadcast by the trainer (HF names -> tensors by models/mapping.py's resolve_in_memory).
Started by cli.py (`python -m megatron_sao engine`).
"""
