"""The model runners (vLLM's v1/worker), torch and mock. Runs in: engine-core process.

model (the tiny Llama-style decoder), attention (paged, over packed tokens), model_runner (batched
execution over the paged KV cache), kv_cache (KV memory other processes map by handle),
kv_cache_sizing (how many blocks fit in device memory), mock_runner (deterministic tokens, no
torch), kv_stamps (the mock runner's marks in real KV memory).
"""
