"""Live running: the wall-clock driver over real processes, `kvdrain serve` (its protocol in serve_messages), its client, recording, monitoring. Runs in: frontend process."""
