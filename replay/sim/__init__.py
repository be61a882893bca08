"""The virtual clock: engine cores, connector workers and the router on a deterministic discrete-event loop. Runs in: frontend process."""
