"""OpenAI-compatible HTTP: the front of `serve --http`, the replay client of `--target http://`, and Prometheus scraping. Runs in: frontend process.

- protocol: the completions request checks and response bodies;
- tokenizer: the front's deterministic text tokenizer;
- tokenize: vLLM's /tokenize as the front answers it;
- server: the HTTP front (completions, models, health, metrics);
- connections: the front's connection cap and header/body timeouts;
- bearer: who may reach a front (loopback, or a bearer key), shared with the proxy;
- chat: its chat completions and batch prompts;
- metrics: its Prometheus metrics, with vLLM's names;
- shared_serve: the HTTP front and the zmq serve on one router, in one asyncio loop;
- client: the replay target over HTTP;
- stream: one streamed completion as that client reads it (its events, its body's end);
- route: the header in which kvdrain's proxy names each completion's way;
- pool: the connection pool of its clients (no connection reused past a server's keep-alive);
- preflight: the checks before its first request (the target, every metrics URL);
- server_facts: what a server says about itself (version, vocabulary, cache config, counters);
- scrape: scraping /metrics into per-engine KV-usage samples;
- outcome: what a replay over HTTP could not observe, and its status.
"""
