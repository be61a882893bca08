"""The process shell (vLLM's v1/engine). Runs in: engine-core process (clients: frontend).

core_proc (the busy loop), messages (wire types and codec), socket_limits (message size caps),
client (EngineClient, in-process or multiprocess), run_dir (private run directories for ipc
sockets), stats_check (checking a decoded StatsSnapshot), lifetime (a child's life bound to
its parent's, and a process's descendants).
"""
