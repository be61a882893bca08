"""Verification: the replay timeline, the verdict rules and the reports. Runs in: frontend process.

- timeline: per-engine samples and per-request records over time;
- windows: the idle windows of the whole trace and each engine's own;
- rules: conservation, drain in idle windows, recorded snapshots;
- coverage: the idle windows a run was expected to observe, and ignored requests;
- outputs: the output check against a single engine;
- latency: `vllm bench serve`'s latency and throughput figures;
- verdict: the exit-code table;
- units: how times read in the text output (seconds, to the millisecond);
- report: the terminal summary, the JSON report and per-request JSONL;
- plot: the usage plot and its CSV data;
- stamp: what produced a report (version, commit, date, host, device).
"""
