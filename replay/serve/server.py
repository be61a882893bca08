"""`kvdrain serve`: the topology behind a client socket, with recording and stats fan-out. Runs in: frontend process.

Clients (replay --target, top) connect a DEALER to the serve's ROUTER. AddRequest (or a
replay's TracedRequest, which --record writes at its trace's time) and Abort go to the
P/D router; a client's outputs come back to it as RequestOutputs.
GetStats subscribes a client to every engine's stats snapshots (ServeInfo first);
clients renew it (ServeClient sends GetStats every SUBSCRIPTION_RENEW_S), and a
subscriber not heard from for SUBSCRIBER_TTL_S is dropped, so clients that left cost
nothing. A client's messages queue in the serve up to MAX_QUEUED_PER_CLIENT: a client that
does not read (a full queue) or has left (its connection is gone) is dropped at the next
message to it, and its requests are aborted, so neither costs memory or engine time.
Garbage is counted and dropped; a frame over the largest legitimate request
(engine/proc/socket_limits.py) drops its connection. Binds 127.0.0.1 (or an ipc path) by default.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from engine.core.outputs import RequestOutput
from engine.proc.client import EngineDeadError
from engine.proc.messages import (
    Abort,
    AddRequest,
    DecodeError,
    GetStats,
    RequestOutputs,
    StatsSnapshot,
    output_to_msg,
)
from engine.proc.socket_limits import request_bytes, set_max_message_size
from replay.deploy.pd_router import PDRouter
from replay.serve.auth import AuthError, AuthOptions, check_listen, secure_server
from replay.serve.messages import ServeInfo, TracedRequest, decode, encode
from replay.serve.recorder import TraceRecorder
from replay.trace.records import MAX_TRACE_T

SUBSCRIPTION_RENEW_S = 5.0  # how often a client says it is still there (GetStats)
SUBSCRIBER_TTL_S = 30.0  # a subscriber not heard from this long is dropped
MAX_NEW_STATS = 10_000  # snapshots kept for the dashboard between two take_stats()
# Messages queued for one client, at most. A ServeClient's own zmq thread takes them as
# they come (its receive queue is unbounded), so only a client that does not read at all
# fills it: a few MB of stats snapshots.
MAX_QUEUED_PER_CLIENT = 10_000


@dataclass(frozen=True, slots=True)
class ServeOptions:
    address: str = "tcp://127.0.0.1:0"  # port 0: any free port, printed at start-up
    record: Path | None = None
    max_model_len: int = 4096  # the engines': sizes the largest request a client may send
    auth: AuthOptions = field(default_factory=AuthOptions)  # replay/serve/auth.py


class ServeError(Exception):
    """The serve cannot start as asked (address in use, unwritable --record, no keys): one line."""


@dataclass(slots=True)
class ServeFront:
    """What can fail before any engine starts: the bound client socket and the open recording."""

    socket: zmq.Socket
    address: str
    recorder: TraceRecorder | None
    authenticator: ThreadAuthenticator | None = None  # with its own context, ended at close
    warnings: list[str] = field(default_factory=list)  # to print at start-up (--insecure)

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
        context = self.socket.context
        self.socket.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
        if context is not zmq.Context.instance():  # a secured socket's own
            context.term()


def recording_metadata(topology: str, liveness: str, block_size: int) -> dict:
    return {"topology": topology, "liveness": liveness, "block_size": block_size}


def open_front(options: ServeOptions, metadata: dict) -> ServeFront:
    """Bind the client socket and open --record for writing; ServeError if either fails.

    `kvdrain serve` calls it before starting the engines, so a bad address or path is a
    one-line error (exit 2) and nothing was started."""
    front = _bind(options)
    try:
        front.recorder = TraceRecorder(options.record, metadata) if options.record else None
    except OSError as e:
        front.close()
        raise ServeError(f"--record {options.record}: cannot write: {e.strerror}") from None
    return front


def _bind(options: ServeOptions) -> ServeFront:
    """The client socket, with its credentials (a context of its own when it has some:
    one ZAP authenticator per context), bound to options.address."""
    try:
        warnings = check_listen(options.address, options.auth)
    except AuthError as e:
        raise ServeError(str(e)) from None
    secured = options.auth.curve_keys is not None or options.auth.token is not None
    socket = (zmq.Context() if secured else zmq.Context.instance()).socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    # A ROUTER silently drops what it cannot queue or route; a client's outputs must never
    # be dropped unseen, so a send that cannot go raises (ROUTER_MANDATORY) and the serve
    # drops that client whole (Server._drop_client).
    socket.setsockopt(zmq.SNDHWM, MAX_QUEUED_PER_CLIENT)
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    set_max_message_size(socket, request_bytes(options.max_model_len))
    front = ServeFront(socket, "", None, None, warnings)
    try:
        front.authenticator = secure_server(socket, options.auth)
        socket.bind(options.address)
    except zmq.ZMQError as e:
        front.close()
        raise ServeError(f"--address {options.address}: {e.strerror}") from None
    except AuthError as e:
        front.close()
        raise ServeError(str(e)) from None
    front.address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    return front


class Server:
    def __init__(
        self,
        router: PDRouter,
        options: ServeOptions,
        info: ServeInfo,
        front: ServeFront | None = None,
    ) -> None:
        """front: open_front's, made before the engines started (opened here if None)."""
        self.router = router
        self.info = info if info.serve_id else replace(info, serve_id=secrets.token_hex(8))
        if front is None:
            front = open_front(
                options, recording_metadata(info.topology, info.liveness, info.block_size)
            )
        self.front = front
        self.socket, self.address, self.recorder = front.socket, front.address, front.recorder
        if self.recorder is not None:  # the pool the engines allocated, for the header
            self.recorder.configure(num_blocks=info.num_blocks, max_model_len=info.max_model_len)
        # Clients choose their ids, and two replays of one trace reuse them, so each
        # request gets a serve-wide unique id: internal id -> (client, client's id).
        self.owners: dict[str, tuple[bytes, str]] = {}
        self.internal_ids: dict[tuple[bytes, str], str] = {}
        self.subscribers: dict[bytes, float] = {}  # identity -> when last heard from
        self.latest: dict[str, StatsSnapshot] = {}
        # Every snapshot since the last take_stats(), for the dashboard's idle windows
        # (bounded: without a reader the oldest go).
        self.new_stats: deque[StatsSnapshot] = deque(maxlen=MAX_NEW_STATS)
        self.num_bad_messages = 0
        self.num_requests = 0
        self.num_expired_subscribers = 0
        self.num_dropped_clients = 0  # that did not read, or had left
        self.num_dropped_requests = 0  # theirs, aborted
        self.clock: Callable[[], float] = time.monotonic
        self._last_expiry = 0.0

    def serve_forever(
        self,
        on_tick: Callable[[Server], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        """Rounds until should_stop(). An engine that died once a stop was asked for ends
        the serve quietly: a SIGTERM to the process group reaches the engines too, and they
        may exit before this loop sees the stop."""
        self.router.request_stats()
        while not should_stop():
            try:
                self.run_once(10)
            except EngineDeadError:
                if should_stop():
                    return
                raise
            if on_tick is not None:
                on_tick(self)

    def run_once(self, timeout_ms: int) -> None:
        """One round: clients' messages (waiting up to timeout_ms), outputs, stats, recording.

        `serve --http` calls it from the HTTP front's loop (replay/serve/fronts.py)."""
        if self.socket.poll(timeout_ms, zmq.POLLIN):
            self._drain_clients()
        for output in self.router.poll(0):
            self._forward(output)
        for snap in self.router.take_stats():
            self._fan_out(snap)
        self._maybe_record_snapshot()
        self._expire_subscribers()

    def _expire_subscribers(self) -> None:
        """Drop subscribers not heard from for SUBSCRIBER_TTL_S (checked once a second)."""
        now = self.clock()
        if now - self._last_expiry < 1.0:
            return
        self._last_expiry = now
        gone = [i for i, heard in self.subscribers.items() if now - heard > SUBSCRIBER_TTL_S]
        for identity in gone:
            del self.subscribers[identity]
        self.num_expired_subscribers += len(gone)

    def _drain_clients(self) -> None:
        while self.socket.poll(0, zmq.POLLIN):
            frames = self.socket.recv_multipart()
            try:
                if len(frames) != 2:
                    raise DecodeError(f"expected [identity, message], got {len(frames)} frames")
                self._handle(frames[0], decode(frames[1]))
                if frames[0] in self.subscribers:  # any message says the client is still there
                    self.subscribers[frames[0]] = self.clock()
            except DecodeError:
                self.num_bad_messages += 1

    def _handle(self, identity: bytes, msg: object) -> None:
        if isinstance(msg, AddRequest):
            self._add(identity, msg, None)
        elif isinstance(msg, TracedRequest):
            if not 0.0 <= msg.trace_t <= MAX_TRACE_T:  # NaN too: a recording stays readable
                self.num_bad_messages += 1
                return
            self._add(identity, msg.request, msg.trace_t)
        elif isinstance(msg, Abort):
            for client_req_id in msg.req_ids:
                req_id = self.internal_ids.get((identity, client_req_id))
                if req_id is None:
                    continue
                self.router.abort(req_id)
                if self.recorder is not None:
                    self.recorder.abort(req_id)
        elif isinstance(msg, GetStats):
            self.subscribers[identity] = self.clock()
            self._send(identity, self.info)
            for snap in self.latest.values():
                self._send(identity, snap)
            self.router.request_stats()
        else:
            self.num_bad_messages += 1

    def _add(self, identity: bytes, msg: AddRequest, trace_t: float | None) -> None:
        """A client's request, under a serve-wide id; recorded at trace_t when the client
        said when its trace meant it sent, else at its arrival."""
        self.num_requests += 1
        req_id = f"{msg.req_id}@{self.num_requests}"
        self.owners[req_id] = (identity, msg.req_id)
        self.internal_ids[(identity, msg.req_id)] = req_id
        self.router.add_request(req_id, msg.prompt_token_ids, msg.max_tokens)
        if self.recorder is not None:
            self.recorder.request(
                req_id, msg.prompt_token_ids, msg.max_tokens, trace_t=trace_t, source=identity
            )

    def _send(self, identity: bytes, msg: object) -> None:
        """Queue msg for the client; one whose queue is full or that has left is dropped."""
        try:
            self.socket.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno not in (zmq.EAGAIN, zmq.EHOSTUNREACH):
                raise
            self._drop_client(identity)

    def _drop_client(self, identity: bytes) -> None:
        """Forget a client that does not read or has left, and abort its requests."""
        was_subscribed = self.subscribers.pop(identity, None) is not None
        theirs = [req_id for req_id, (owner, _) in self.owners.items() if owner == identity]
        if not (was_subscribed or theirs):
            return  # dropped already, or never known
        self.num_dropped_clients += 1
        self.num_dropped_requests += len(theirs)
        for req_id in theirs:
            _, client_req_id = self.owners.pop(req_id)
            self.internal_ids.pop((identity, client_req_id), None)
            self.router.abort(req_id)
            if self.recorder is not None:
                self.recorder.abort(req_id)

    def _forward(self, output: RequestOutput) -> None:
        owner = self.owners.get(output.req_id)
        if owner is None:
            return
        identity, client_req_id = owner
        if output.finished:
            del self.owners[output.req_id]
            if self.internal_ids.get(owner) == output.req_id:  # the id may be reused since
                del self.internal_ids[owner]
        self._send(identity, RequestOutputs("serve", [output_to_msg(output, client_req_id)]))

    def take_stats(self) -> list[StatsSnapshot]:
        """Every engine snapshot since the last call, in arrival order."""
        stats = list(self.new_stats)
        self.new_stats.clear()
        return stats

    def _fan_out(self, snap: StatsSnapshot) -> None:
        self.latest[snap.engine_id] = snap
        self.new_stats.append(snap)
        for identity in list(self.subscribers):  # _send may drop one
            self._send(identity, snap)

    def _maybe_record_snapshot(self) -> None:
        if self.recorder is not None:  # written once settled (replay/serve/recorder.py)
            self.recorder.snapshot(self.latest, in_flight=self.router.has_pending)

    def close(self) -> None:
        self.front.close()
