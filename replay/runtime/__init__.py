"""What every run shares while it runs. Runs in: frontend process.

interrupt (Ctrl-C, SIGTERM and `q`, one way), heap (the garbage collector's policy),
starvation (what /proc says of a silent process), startup (judging processes that start),
clocks (the wall and the virtual clock a replay runs on).
"""
