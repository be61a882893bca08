"""The pure core: scheduling and KV block bookkeeping, no torch, zmq, clock, randomness or I/O. Runs in: engine-core process (and the simulator).

- request: Request and RequestStatus;
- block_hash: chained prefix hashes of full blocks;
- block_pool: the paged block pool with prefix caching;
- kv_cache_manager: per-request block tables over the pool;
- invalid_blocks: what a failed KV load leaves a request;
- scheduler: queues, token budget, preemption and the connector lifecycle;
- async_scheduler: the same with step N+1 scheduled before step N's output (vLLM's AsyncScheduler);
- release: which vLLM release the miniature follows, and what each release does;
- batch_queue: the engine core's batch queue for async scheduling (step_with_batch_queue);
- stop: stop conditions;
- decode_run: runs of plain decode steps taken at once (the simulator's);
- outputs: the records scheduler -> runner -> scheduler -> frontend;
- kv_connector: the interfaces a connector implements;
- liveness: the engine loop's policies (may it block, and on what?);
- request_check: the limits every front checks before sending;
- engine_core: EngineCore.step, driven by the process shell and the simulator alike.
"""
