"""The wall-clock replay over real engine processes. Runs in: frontend process.

driver (sends on the clock, samples the engines), faults (dead, hung, stalled or starved).
"""
