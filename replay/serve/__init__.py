"""`kvdrain serve`: the miniature behind a client socket and an HTTP front. Runs in: frontend process.

server (the topology behind the zmq socket), client, messages, auth, recorder (--record),
http_front (`serve --http`), fronts (both on one loop), chat, tokenize_endpoint,
vllm_metrics (/metrics), connections (the front's connection guard).
"""
