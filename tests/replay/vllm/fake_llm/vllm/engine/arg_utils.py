"""vLLM's EngineArgs, faked: the options kvdrain passes. Runs in: a test's child process."""

from __future__ import annotations

import json


class EngineArgs:
    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--served-model-name", nargs="+", default=None)
        parser.add_argument("--kv-transfer-config", type=json.loads, default=None)
        parser.add_argument("--max-num-seqs", type=int, default=256)
        return parser
