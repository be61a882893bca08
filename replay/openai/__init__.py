"""The OpenAI-compatible HTTP API as kvdrain speaks it. Runs in: frontend and proxy processes.

protocol (request checks, bodies, strict JSON), tokenizer (the word tokenizer), bearer
(who may reach a front), pool (the clients' connections), route_header (the proxy's way).
"""
