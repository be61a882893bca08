"""Trace I/O: the formats kvdrain reads, prompt synthesis from hash ids, shaping, inspection. Runs in: frontend process.

- records: what one line of a trace means, whatever its format;
- formats: the line parsers (kvdrain JSONL, Mooncake JSONL, Azure CSV);
- reader: streaming readers and format detection;
- source: the trace's bytes: a non-regular file read once into a bounded copy, changes detected;
- limits: the engines' limits requests are checked against;
- faults: the faults a trace asks for, and what a target can carry out of them;
- fault_shares: seeded shares of faults put into any trace (`--fault`);
- synth: prompt token ids synthesised from hash ids;
- shaping: window, gap caps, idle insertion, token scaling, fault shares;
- inspect: `kvdrain inspect`.
"""
