"""The P/D router in the frontend (vLLM's disaggregated proxy) and the topology launcher. Runs in: frontend process.

`pd`: each request goes to the prefill engine with do_remote_decode and max_tokens=1;
P's final output carries the params its connector returned, and the request goes to
the decode engine with them and the real max_tokens; D's tokens are the answer.
`single`: one engine, no connector.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, replace

from connector.routing import (END, PREFILL_MAX_TOKENS, RELEASE, TOPOLOGIES,  # noqa: F401
                               after_prefill, engine_roles, prefill_params)
from engine.client import EngineClient, InprocClient, MPClient, make_run_dir, wait_for_output
from engine.config import EngineConfig, KVTransferConfig
from engine.outputs import RequestOutput


@dataclass(slots=True)
class _Pending:
    prompt_token_ids: list[int]
    max_tokens: int
    stage: str  # "prefill" | "decode"
    aborted: bool = False  # the client gave up while P was prefilling


def engine_configs(base: EngineConfig, kv: KVTransferConfig, topology: str,
                   run_dir: str) -> list[EngineConfig]:
    """One config per engine, with addresses in the private run directory."""
    return [replace(base, engine_id=name, kv_transfer=None if role is None else replace(
        kv, kv_role=role, kv_addr=f"ipc://{run_dir}/{name}-kv", agent_addr=f"ipc://{run_dir}/{name}-agent"))
        for name, role in engine_roles(topology)]


class PDRouter:
    def __init__(self, clients: list[EngineClient], run_dir: str | None = None) -> None:
        self.clients = {c.engine_id: c for c in clients}
        self.prefill = clients[0]
        self.decode = clients[1] if len(clients) > 1 else None
        self.run_dir = run_dir
        self.pending: dict[str, _Pending] = {}
        self.errors: list[tuple[str, str]] = []

    @property
    def engines(self) -> list[str]:
        return list(self.clients)

    @property
    def vocab_size(self) -> int:
        client = self.prefill
        if isinstance(client, MPClient) and client.ready is not None:
            return client.ready.vocab_size
        return client.core.config.model.vocab_size

    @property
    def has_pending(self) -> bool:
        return bool(self.pending)

    def request_stats(self) -> None:
        for client in self.clients.values():
            if isinstance(client, MPClient):
                client.request_stats()

    def take_stats(self) -> list:
        """Stats snapshots that arrived since the last call, every engine's."""
        return [s for c in self.clients.values() if isinstance(c, MPClient) for s in c.take_stats()]

    def add_request(self, req_id: str, prompt_token_ids: list[int], max_tokens: int,
                    pd: bool | None = None) -> None:
        """pd=False sends a request of a pd topology to the decode engine alone."""
        if req_id in self.pending:
            raise ValueError(f"request id {req_id!r} is already in flight")
        if self.decode is None or pd is False:
            engine = self.prefill if self.decode is None else self.decode
            engine.add_request(req_id, prompt_token_ids, max_tokens)
            self.pending[req_id] = _Pending(prompt_token_ids, max_tokens, "decode")
            return
        self.pending[req_id] = _Pending(prompt_token_ids, max_tokens, "prefill")
        self.prefill.add_request(req_id, prompt_token_ids, PREFILL_MAX_TOKENS, prefill_params())

    def abort(self, req_id: str) -> None:
        pending = self.pending.get(req_id)
        if pending is None:
            return
        if pending.stage == "prefill":
            pending.aborted = True  # P may finish first; see routing.after_prefill
            self.prefill.abort([req_id])
        else:
            (self.decode or self.prefill).abort([req_id])

    def poll(self, timeout_s: float) -> list[RequestOutput]:
        """The user-facing outputs (the decode engine's tokens) that arrive within timeout_s."""
        self._wait(timeout_s)
        outputs: list[RequestOutput] = []
        for client in self.clients.values():
            for output in client.get_outputs(0):
                outputs.extend(self._route(client, output))
            errors = getattr(client, "errors", [])
            while errors:
                self.errors.append((client.engine_id, errors.pop(0)))
        return outputs

    def _wait(self, timeout_s: float) -> None:
        clients = list(self.clients.values())
        if timeout_s > 0 and all(isinstance(c, MPClient) for c in clients):
            wait_for_output(clients, timeout_s)

    def _route(self, client: EngineClient, output: RequestOutput) -> list[RequestOutput]:
        pending = self.pending.get(output.req_id)
        if pending is None:
            return []
        if client is self.prefill and self.decode is not None and pending.stage == "prefill":
            if not output.finished:
                return []
            action, params = after_prefill(output, pending.aborted)
            if action == END and pending.aborted:  # the client asked: it ends as an abort
                del self.pending[output.req_id]
                return [RequestOutput(output.req_id, [], "abort")]
            if action != END:
                pending.stage = "decode"
                self.decode.add_request(output.req_id, pending.prompt_token_ids,
                                        pending.max_tokens, params)
                if action == RELEASE:
                    self.decode.abort([output.req_id])
                return []
        if output.finished:
            del self.pending[output.req_id]
        return [output]

    def shutdown(self) -> None:
        # Decode first: its reads release the prefill engine's held blocks.
        for client in reversed(list(self.clients.values())):
            client.shutdown()
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def start_topology(base: EngineConfig, kv: KVTransferConfig, topology: str = "pd",
                   inproc: bool = False) -> PDRouter:
    """Start every engine (and, through their connectors, the connector workers)."""
    run_dir = make_run_dir()
    clients: list[EngineClient] = []
    try:
        for config in engine_configs(base, kv, topology, run_dir):
            clients.append(InprocClient(config) if inproc else MPClient(config, run_dir, wait=False))
        for client in clients:  # the engines start in parallel
            if isinstance(client, MPClient):
                client.wait_ready()
    except BaseException:
        for client in clients:
            client.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return PDRouter(clients, run_dir)
