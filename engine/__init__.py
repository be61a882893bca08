"""The engine core: a miniature of vLLM v1's, in three rings. Runs in: engine-core process (the clients: frontend).

- the pure core: request, block_pool (+ block_hash), kv_cache_manager, scheduler (+ stop),
  outputs, kv_connector (the interfaces a connector implements), core (EngineCore.step),
  liveness; no torch, zmq, clock or randomness, so the virtual-clock simulator drives it too;
- the process shell: core_proc (busy loop, sockets, liveness policy), messages (the wire
  types and codec), client (EngineClient: in-process or multiprocess), config;
- the model runner: model, attention, kv_cache (shareable KV memory), model_runner (torch)
  and mock_runner (deterministic, torch-free).
Imports nothing from connector/, replay/ or cli.py: the connector arrives as a factory
named in the config.
"""
