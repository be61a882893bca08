"""The P/D KV connector, plugged into engine/'s interfaces. Runs in: engine-core and connector-worker processes.

- engine-core side: pd (the pull-mode scheduler-side policy, NIXL-like), heartbeats (D's
  lease heartbeats), factory (builds the connector named in the engine config), agent (the
  in-engine agent that spawns and talks to the connector worker process);
- connector-worker side: worker_proc (the process), send_ledger (the prefill side's
  protocol, sans IO), pull_outcome (what D's worker does once a pull ends, sans IO),
  transfer (block copies);
- messages: the wire types of both, on the engine's codec.
Imports engine/ only.
"""
