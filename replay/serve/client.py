"""ServeClient: a client of `kvdrain serve` over one DEALER socket. Runs in: frontend process.

A replay target like the local PDRouter (replay/wall/driver.py's ReplayTarget). Used by
`replay --target` (it sends requests and reads outputs and stats) and by `top` (it only
subscribes to stats). Every wait is bounded; the serve's death shows
as silence, reported after a timeout.
"""

from __future__ import annotations

import time

import zmq

from engine.core.outputs import RequestOutput
from engine.proc.messages import (
    Abort,
    AddRequest,
    DecodeError,
    GetStats,
    RequestOutputs,
    StatsSnapshot,
    output_from_msg,
)
from engine.proc.socket_limits import CLIENT_CAP_BYTES, set_max_message_size
from engine.proc.stats_check import snapshot_problem
from replay.serve.auth import AuthError, AuthOptions, secure_client
from replay.serve.messages import ServeInfo, TracedRequest, decode, encode
from replay.serve.server import SUBSCRIPTION_RENEW_S

CONNECT_TIMEOUT_S = 5.0
PING_AFTER_S = 1.0  # silent this long: ask for stats (the serve answers at once)
LOST_AFTER_S = 10.0  # silent this long despite the pings: the serve is gone


class TargetLostError(ConnectionError):
    """The serve answered at first, then stopped answering (it died or hangs)."""


class ServeClient:
    def __init__(
        self,
        address: str,
        timeout_s: float = CONNECT_TIMEOUT_S,
        lost_after_s: float | None = None,
        auth: AuthOptions | None = None,
    ) -> None:
        """auth: the credentials a serve that requires them checks (replay/serve/auth.py)."""
        self.address = address
        self.lost_after_s = LOST_AFTER_S if lost_after_s is None else lost_after_s
        self.last_heard = self.last_ping = time.monotonic()
        # (engine, message): a restart of the serve ("" for the engine); the serve does not
        # forward its engines' errors.
        self.errors: list[tuple[str, str]] = []
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)  # the serve's ROUTER would drop what we cannot queue
        set_max_message_size(self.socket, CLIENT_CAP_BYTES)
        try:
            secure_client(self.socket, auth)
            self.socket.connect(address)
        except AuthError as e:  # a usage error, reported like an unreachable target (exit 2)
            self.socket.close(linger=0)
            raise ConnectionError(str(e)) from None
        except zmq.ZMQError as e:
            self.socket.close(linger=0)
            raise ConnectionError(f"cannot connect to {address!r}: {e}") from None
        self.new_stats: list[StatsSnapshot] = []
        self.latest: dict[str, StatsSnapshot] = {}
        self.num_bad_messages = 0
        self.info: ServeInfo | None = (
            None  # snapshots before it are dropped: no engines to check against
        )
        # A serve restarted at the same address (zmq reconnects by itself): one line each,
        # as the client noticed them (its ServeInfo.serve_id changed).
        self.restarts: list[str] = []
        self.info = self._subscribe(timeout_s)

    def _subscribe(self, timeout_s: float) -> ServeInfo:
        self.socket.send(encode(GetStats()))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.socket.poll(50, zmq.POLLIN):
                msg = self._recv()
                if isinstance(msg, ServeInfo):
                    return msg
        self.socket.close(linger=0)
        raise ConnectionError(
            f"no kvdrain serve answered at {self.address} within {timeout_s} s "
            f"(one that requires --curve-keys or --token ignores clients without them)"
            + _http_hint(self.address)
        )

    @property
    def engines(self) -> list[str]:
        return list(self.info.engines)

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def _recv(self) -> object | None:
        self.last_heard = time.monotonic()
        try:
            msg = decode(self.socket.recv())
        except DecodeError:
            self.num_bad_messages += 1
            return None
        if (
            isinstance(msg, ServeInfo)
            and self.info is not None
            and msg.serve_id != self.info.serve_id
        ):
            self._on_restart(msg)
        if isinstance(msg, StatsSnapshot):
            if self.info is None or snapshot_problem(msg, self.info.engines) is not None:
                self.num_bad_messages += 1  # forged or broken: never used
                return None
            self.latest[msg.engine_id] = msg
            self.new_stats.append(msg)
        return msg

    def _on_restart(self, info: ServeInfo) -> None:
        """Another serve answers at this address: what came before was another's engines.
        Its engines' numbers start again (latest is cleared); a replay's requests sent to the
        old one are lost, so the restart is also an error (a replay's fault)."""
        notice = (
            f"the kvdrain serve at {self.address} restarted (another serve answers since "
            f"{time.strftime('%H:%M:%S')}): its engines' counts start again"
        )
        self.restarts.append(notice)
        self.errors.append(("", notice))
        self.latest.clear()
        self.info = info

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        pd: bool | None = None,
        trace_t: float | None = None,
    ) -> None:
        """pd is the serve's to decide (its topology); a per-request flag is not sent.
        trace_t (when the trace meant it sent) goes with it, for the serve's recording."""
        request = AddRequest(req_id, list(prompt_token_ids), max_tokens)
        self.socket.send(encode(request if trace_t is None else TracedRequest(request, trace_t)))

    def abort(self, req_id: str) -> None:
        self.socket.send(encode(Abort([req_id])))

    def request_stats(self) -> None:
        self.last_ping = time.monotonic()
        self.socket.send(encode(GetStats()))

    def take_stats(self) -> list[StatsSnapshot]:
        stats, self.new_stats = self.new_stats, []
        return stats

    def poll(self, timeout_s: float) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if time.monotonic() - self.last_ping > SUBSCRIPTION_RENEW_S:
            self.request_stats()  # renews the subscription: the serve drops silent subscribers
        if not self.socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            self._check_alive()
            return outputs
        while self.socket.poll(0, zmq.POLLIN):
            msg = self._recv()
            if isinstance(msg, RequestOutputs):
                outputs.extend(output_from_msg(o) for o in msg.outputs)
        return outputs

    def _check_alive(self) -> None:
        """Ping a silent serve; raise TargetLostError when it stays silent."""
        now = time.monotonic()
        silent = now - self.last_heard
        if silent > self.lost_after_s:
            raise TargetLostError(
                f"the kvdrain serve at {self.address} stopped answering "
                f"({silent:.0f} s without a message); did it stop?"
            )
        if silent > PING_AFTER_S and now - self.last_ping > PING_AFTER_S:
            self.last_ping = now
            self.socket.send(encode(GetStats()))

    def shutdown(self) -> None:
        """Disconnect; the serve keeps running."""
        self.socket.close(linger=0)


def _http_hint(address: str) -> str:
    """For a tcp:// address: what to give if an HTTP server (vLLM, SGLang, serve --http) is there."""
    if not address.startswith("tcp://"):
        return ""
    host_port = address[len("tcp://") :]
    return (
        f"; an OpenAI-compatible HTTP server there? replay --target http://{host_port}, "
        f"top --metrics http://{host_port}/metrics"
    )
