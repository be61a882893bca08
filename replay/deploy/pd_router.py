"""The P/D router in the frontend (vLLM's disaggregated proxy) over engine clients. Runs in: frontend process.

replay/deploy/pd_flow.py decides each request's way (P with max_tokens=1, then D with P's
params; D alone; E alone); this class carries its commands out on the clients and hands
the client-facing outputs (D's tokens) back. It launches nothing: replay/deploy/topology.py
starts the engines and hands their clients here.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable

from engine.core.outputs import RequestOutput
from engine.core.request_check import RequestLimits, why_invalid, why_malformed
from engine.proc.client import EngineClient, wait_for_output
from engine.proc.messages import StatsSnapshot
from replay.deploy.pd_flow import AddTo, Command, Routing, engine_names
from replay.deploy.placement import RouterPolicy


class PDRouter:
    def __init__(
        self,
        clients: list[EngineClient],
        run_dir: str | None = None,
        topology: str | None = None,
        policy: RouterPolicy = "round-robin",
    ) -> None:
        """clients: as engine_roles lists them, the prefill engines first; topology: theirs
        (default: one client is single, two are pd); run_dir (their sockets) is removed at shutdown."""
        self.clients = {c.engine_id: c for c in clients}
        topology = topology or ("single" if len(clients) == 1 else "pd")
        prefill, decode = engine_names(topology)
        if prefill + decode != list(self.clients):
            raise ValueError(
                f"clients {list(self.clients)} are not topology {topology}'s {prefill + decode}"
            )
        self.routing = Routing(prefill, decode, policy)
        # Told (req_id, engine) each time a request is given to an engine (a replay's
        # driver records each request's way with it); None: nobody asked.
        self.on_move: Callable[[str, str], None] | None = None
        self.run_dir = run_dir
        self.errors: list[tuple[str, str]] = []  # (engine, message), every engine's, oldest first
        self._rejected: list[RequestOutput] = []  # refused at the front, for the next poll
        self.num_rejected = 0
        # The prefill engine's finished requests by finish reason (the prefill-only ones the
        # client never sees included), as a vLLM P server counts them.
        self.prefill_finished: dict[str, int] = {}
        self._limits: RequestLimits | None = None

    @property
    def engines(self) -> list[str]:
        return list(self.clients)

    @property
    def vocab_size(self) -> int:
        return next(iter(self.clients.values())).wait_ready().vocab_size

    @property
    def num_blocks(self) -> int:
        """The smallest engine's KV pool as it reported it (sized from GPU memory, maybe),
        the null block included."""
        return min(c.wait_ready().num_blocks for c in self.clients.values())

    @property
    def has_pending(self) -> bool:
        return bool(self.routing.routes)

    @property
    def live_clients(self) -> list[EngineClient]:
        """The clients of engines not lost (killed: lose_engine)."""
        return [c for e, c in self.clients.items() if e not in self.routing.gone]

    def lose_engine(self, engine: str) -> None:
        """`engine` was killed: never polled nor sent to again, and the requests there
        lost (the routing's LOST events)."""
        self.routing.engine_gone(engine)

    def request_stats(self) -> None:
        for client in self.live_clients:
            client.request_stats()

    def take_stats(self) -> list[StatsSnapshot]:
        """Stats snapshots that arrived since the last call, every engine's."""
        return [s for c in self.clients.values() for s in c.take_stats()]

    @property
    def limits(self) -> RequestLimits:
        """What the engines take (every engine of a topology has the same config)."""
        if self._limits is None:
            ready = next(iter(self.clients.values())).wait_ready()
            self._limits = RequestLimits(ready.max_model_len, ready.vocab_size)
        return self._limits

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        pd: bool | None = None,
        trace_t: float | None = None,
        fault: str | None = None,
    ) -> None:
        """pd=False sends a request of a pd topology to the decode engine alone; trace_t
        (when a replay's trace meant it sent) is a serve recording's, not the router's;
        fault: the trace's drop_decode or reject_decode (replay/deploy/pd_flow.py).

        Checked here first, once for every front (serve, the HTTP server, a replay): a
        request no engine can take is answered at the next poll and never sent, so P
        never holds blocks for a D that would refuse it: a malformed one with an error,
        one over max_model_len ignored, as an engine's scheduler ignores it."""
        why = why_invalid(prompt_token_ids, max_tokens, self.limits)
        if why is not None:
            self.num_rejected += 1
            # A request too long for max_model_len ends as the engines' schedulers end it,
            # ignored ("length", no token, the cause: a replay counts it as ignored); a
            # malformed one is an error.
            malformed = why_malformed(prompt_token_ids, max_tokens, self.limits.vocab_size)
            self._rejected.append(
                RequestOutput(req_id, [], "error" if malformed else "length", error=why)
            )
            return
        self._send(self.routing.add(req_id, prompt_token_ids, max_tokens, pd, fault=fault))

    def abort(self, req_id: str, when: str | None = None) -> None:
        """when: at the first moment the request is in that phase (Routing.abort)."""
        self._send(self.routing.abort(req_id, when))

    def poll(self, timeout_s: float) -> list[RequestOutput]:
        """The user-facing outputs (the decode engine's tokens) that arrive within timeout_s."""
        outputs, self._rejected = self._rejected, []
        clients = self.live_clients
        wait_for_output(clients, 0 if outputs else timeout_s)
        for client in clients:
            for output in client.get_outputs(0):
                routed = self.routing.on_output(client.engine_id, output)
                if routed.action is not None:  # P's final output
                    reason = output.finish_reason or "error"
                    self.prefill_finished[reason] = self.prefill_finished.get(reason, 0) + 1
                self._send(routed.commands)
                if routed.output is not None:
                    outputs.append(routed.output)
            while client.errors:
                self.errors.append((client.engine_id, client.errors.pop(0)))
        return outputs

    def _send(self, commands: list[Command] | tuple[Command, ...]) -> None:
        for command in commands:
            client = self.clients[command.engine]
            if isinstance(command, AddTo):
                if self.on_move is not None:
                    self.on_move(command.req_id, command.engine)
                client.add_request(
                    command.req_id,
                    command.prompt_token_ids,
                    command.max_tokens,
                    command.kv_transfer_params,
                )
            else:
                client.abort([command.req_id])

    def shutdown(self) -> None:
        """Every client's shutdown runs, and then the run dir goes, even if one raises
        (a Ctrl-C during another's shutdown): an ExitStack runs them all."""
        with contextlib.ExitStack() as stack:
            if self.run_dir is not None:
                stack.callback(shutil.rmtree, self.run_dir, ignore_errors=True)
            for client in self.clients.values():  # last in, first out: decode first, its
                stack.callback(client.shutdown)  # reads release the prefill engine's blocks
