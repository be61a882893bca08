"""kvdrain replay: traces in, verdicts out. Runs in: frontend process.

One subpackage per concern:
- trace/   reading traces (kvdrain JSONL, Mooncake, Azure), prompt synthesis, shaping, inspect
- sim/     the virtual clock: EngineCores on a deterministic discrete-event loop
- live/    real processes in real time: the wall-clock driver, `serve`, its client, recording,
           the dashboard's feed (monitor)
- http/    the OpenAI-compatible HTTP front and its replay client
- deploy/  the frontend's P/D routing, the router over engine clients, launching topologies
- verify/  the timeline, the verdict rules (conservation, drain, snapshots) and reports
- ui/      the live dashboard: its state (plain data) and its rich view
pipeline.py runs one replay (validate, shape, drive, verify); commands.py is what each CLI verb does;
heap.py is the garbage collector's policy while a replay runs (the virtual clock's and the HTTP client's).
"""
