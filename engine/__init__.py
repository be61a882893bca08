"""The engine core: a miniature of vLLM v1's, in three rings, one folder each. Runs in: engine-core process (the clients: frontend).

- core/    the pure core (vLLM's v1/core): bookkeeping only, no torch, zmq, clock,
           randomness or I/O, so the virtual-clock simulator drives it too;
- proc/    the process shell (vLLM's v1/engine): the busy loop, wire types, clients;
- runner/  the model runners (vLLM's v1/worker): torch model, paged KV memory, mock runner.
At this root: config (the plain configuration every ring reads), profiles (deployment
sizes) and utils (pure arithmetic).
Imports nothing from connector/, replay/ or cli.py: the connector arrives as a factory
named in the config.
"""
