"""Real vLLM launched by kvdrain, and the P/D proxy in front. Runs in: frontend process.

options, launch (instances started, watched, stopped), tiny_model (the default model's
files), cpu (what a CPU host needs), orphans (what a killed run left), idle_cpu (spinning
threads lowered), inproc_producer (vLLM's LLM class as P, run by the vLLM venv's
python), proxy (`kvdrain proxy`), with proxy_options, upstream (each exchange
bounded) and pd_request (P's and D's requests).
"""
