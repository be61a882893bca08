"""Live running: the wall-clock driver over real processes, `kvdrain serve`, its client, recording, monitoring. Runs in: frontend process.

- driver: the wall-clock replay over real engine processes;
- faults: an engine or worker that died, stopped answering or stalled, named;
- starvation: starved or stuck, from what /proc says of a silent engine;
- interrupt: Ctrl-C and SIGTERM as one exception;
- serve: `kvdrain serve`, the topology behind a client socket;
- serve_messages: the serve's protocol (its wire types, ServeInfo among them);
- serve_client: a client of `kvdrain serve`;
- auth: who may talk to a serve (CURVE beyond loopback, a token on it);
- recorder: `serve --record`;
- monitor: the dashboard's feeds (a replay, a serve, `top`, scraped metrics);
- metrics_top: `kvdrain top --metrics`, any server's Prometheus metrics on the dashboard;
- calibrate: `kvdrain calibrate`, a cost profile from the real runner.
"""
