"""What each CLI verb does once its options are parsed. Runs in: frontend process.

replay (what its options mean together; replay_options declares them, replay_run runs and
reports, replay_vllm launches real vLLM for it), serve, top, inspect, calibrate, proxy, keys,
explain, sweep; groups (option groups several verbs take), options (how groups and renamed flags
are declared), terminal (what they print alike). cli.py and this package alone import
click; rich too, with replay/ui/ and replay/verify/report.py.
"""
