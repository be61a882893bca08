"""Sweeps: a grid of virtual replays, one table out. Runs in: frontend process and sweep workers.

spec (the TOML grid and its cells), cell (one cell run as a `kvdrain replay` process, its
report reduced to a row), table (the rows as CSV and a plot), executors (where cells run:
this machine's cores, or a Ray cluster).
"""
