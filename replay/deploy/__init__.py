"""Deployments in front of the engines: P/D routing, the router over engine clients, launching. Runs in: frontend process.

- routing: each request's way from P to D, sans IO (vLLM's disaggregated proxy as a state
  machine, driven by the live router and the simulator alike);
- balance: which prefill and decode engine takes each request (round-robin, least-loaded,
  prefix), one decision table for every router;
- router: PDRouter, that state machine over engine clients;
- topology: launching a topology's engine cores with their connector configs;
- proxy: `kvdrain proxy`, vLLM's P/D protocol in front of vLLM servers (aiohttp);
- vllm_options, vllm_launch, vllm_model, vllm_replay: `replay --engine vllm`, real `vllm
  serve` instances launched, watched and torn down, their default tiny model, the replay
  through them;
- vllm_orphans: the run directory's record of what was launched, and stopping what a
  SIGKILLed run left running;
- idle_cpu: how many cores the launched instances burn before the first request, and
  their threads that spin then, lowered to nice 19 on a CPU host;
- vllm_cpu: the tiny model's dtype on this host's CPU (float16 where AMX is), and the
  hint a SIGILL in an instance's log earns.
"""
