"""The P/D KV connector, plugged into engine/'s interfaces. Runs in: engine core, connector worker.

Engine-core side: pd (the scheduler side, pull mode, NIXL-like), heartbeats (D's lease
heartbeats), factory (builds it from the engine config), agent (spawns and talks to the worker).
Worker side: worker_proc (the process), send_ledger (P's sends, sans IO), pull_outcome (the end
of D's pull, sans IO), transfer (block copies). messages: both sides' wire types. Imports engine/.
"""
