"""Verification: the timeline, the verdict rules and the reports. Runs in: frontend process.

timeline, windows, rules, contract (what each release promises for P's blocks), safety
(blocks freed before D read them), coverage, outcome (what an HTTP run could not observe), outputs,
latency, verdict (the exit codes), units, text (what a peer wrote, escaped), report,
plot, stamp.
"""
