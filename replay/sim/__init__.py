"""The virtual clock: engine cores, connector workers and the router on a deterministic discrete-event loop. Runs in: frontend process.

- options: what a simulation is set by;
- clock: the discrete-event loop;
- cost: the step cost, fitted from a calibration;
- engine: one simulated engine (EngineCore's busy loop on virtual time);
- decode_run: a run of plain decode steps skipped as one (its step times and outputs);
- kv_worker: the connector worker on virtual time;
- gone_worker: a killed engine's connector worker, refusing every read;
- simulation: a whole replay on the virtual clock.
"""
