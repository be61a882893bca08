"""The live dashboard: its state as plain data and its rich rendering. Runs in: frontend process.

- dashboard: the state (plain data, no rich);
- tui: the pure rich render and the LiveView around it.
"""
