"""kvdrain's frontend: traces in, verdicts out. Runs in: frontend process.

A room per product, bottom to top (each imports only rooms below it): trace, verify,
runtime, openai, metrics, deploy, sim, target, wall, serve, vllm, pipeline (one replay,
prepare then run), ui, sweep, commands.
"""
