"""The live dashboard: its state as plain data and its rich rendering. Runs in: frontend process."""
