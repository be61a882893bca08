"""The engine core, a miniature of vLLM v1's. Runs in: engine-core process (clients: frontend).

- core/ (v1/core): pure bookkeeping, no torch, zmq, clock, randomness or I/O (the simulator's too);
- proc/ (v1/engine): the busy loop, wire types, clients; runner/ (v1/worker): the model runners.
At the root: config, profiles (deployment sizes), utils. Imports neither connector/ nor replay/:
the connector is a factory named in the config.
"""
