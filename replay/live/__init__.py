"""Live running: the wall-clock driver over real processes, `kvdrain serve`, its client, recording, monitoring. Runs in: frontend process."""
