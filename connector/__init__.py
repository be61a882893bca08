"""The P/D KV connector, plugged into engine/'s interfaces, and the P/D router in front of the engines.

- scheduler side: pd (pull-mode policy, NIXL-like), built with the worker side by factory;
- worker side: agent (inside the engine-core process), worker_proc (the connector worker
  process) around send_ledger (the prefill side's protocol, sans IO), transfer (block
  copies), messages (their wire types);
- frontend: routing (each request's way P -> D, sans IO), router (PDRouter over engine
  clients), topology (launching the engines with their connector configs).
Imports engine/ only.
"""
