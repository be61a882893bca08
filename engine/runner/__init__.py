"""The model runners: a torch model over a paged KV cache, and a mock. Runs in: engine-core process.

- model: the tiny Llama-style decoder;
- attention: paged attention over packed tokens;
- kv_cache: KV memory other processes map by handle;
- kv_cache_sizing: how many blocks fit in device memory (pure arithmetic);
- model_runner: batched execution over the paged KV cache (torch);
- mock_runner: deterministic tokens, no torch;
- kv_stamps: the mock runner's marks in real KV memory.
"""
