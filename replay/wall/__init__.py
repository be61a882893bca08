"""The wall-clock replay over real engine processes. Runs in: frontend process.

driver (sends on the clock, samples the engines), faults (dead, hung, stalled or starved),
engine_faults (a trace's pauses and kills, carried out on the engine processes).
"""
