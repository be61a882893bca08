"""The process shell: the engine-core process, its wire types and its clients. Runs in: engine-core process (the clients: frontend).

- core_proc: the busy loop, its sockets and the liveness policy;
- messages: the wire types frontend <-> engine core and the msgpack codec;
- socket_limits: message size caps for every socket;
- client: EngineClient, in-process or multiprocess;
- run_dir: private run directories for ipc sockets;
- stats_check: checking a decoded StatsSnapshot;
- lifetime: a child's life bound to its parent's (killed mid start-up).
"""
