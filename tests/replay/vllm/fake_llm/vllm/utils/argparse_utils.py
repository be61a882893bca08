"""vLLM's FlexibleArgumentParser, faked: other options ignored. Runs in: a test's child process."""

from __future__ import annotations

import argparse


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_args(self, args=None, namespace=None):
        return self.parse_known_args(args, namespace)[0]
