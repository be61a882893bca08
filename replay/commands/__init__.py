"""What each CLI verb does once its options are parsed. Runs in: frontend process.

replay, replay_vllm (`replay --engine vllm`), calibrate, sweep (`kvdrain sweep`).
"""
