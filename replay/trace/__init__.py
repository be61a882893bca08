"""Trace I/O: the formats kvdrain reads, prompt synthesis from hash ids, shaping, inspection. Runs in: frontend process."""
