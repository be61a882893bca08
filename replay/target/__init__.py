"""Replaying against a running HTTP server (`replay --target http://`). Runs in: frontend process.

client (the replay), stream (one streamed completion), preflight (the checks before it),
server_facts (what a server says about itself).
"""
