"""Who may talk to a serve: CURVE keys beyond loopback, an optional shared token on it. Runs in: frontend process.

A serve listening beyond this machine (`--address tcp://0.0.0.0:PORT`, a LAN address,
an interface name) must have `--curve-keys DIR`: pyzmq's CURVE, with a
ThreadAuthenticator that lets in only clients whose public key is in DIR. `kvdrain
keys DIR` makes the pairs (server.key, server.key_secret, client.key,
client.key_secret; DIR 0700, secrets 0600): the serve reads server.key_secret and
trusts every *.key in DIR; a client (replay --target, top) reads client.key_secret
and server.key (copy those two to its machine). `--insecure` listens without keys
and says so loudly. The HTTP front of `serve --http` follows the same rule with `--api-key`
(replay/openai/bearer.py).
On loopback and ipc any local user can connect, so a shared
`--token` (or KVDRAIN_TOKEN, which `ps` does not show) may be required: ZMQ's PLAIN
handshake checks it once per connection, so a client without it never gets a message
through. (PLAIN sends the token in clear: on loopback only.) The engines' ipc sockets,
GetKVHandle among them, live in the run directory (mode 0700): only this uid reaches
them (engine/proc/run_dir.py); the KV memory itself is a 0600 file.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SERVER, CLIENT = "server", "client"
TOKEN_USER = "kvdrain"
LOCAL_SCHEMES = ("ipc://", "inproc://")


class AuthError(Exception):
    """Credentials missing, unreadable or contradictory: one line, exit 2."""


@dataclass(frozen=True, slots=True)
class AuthOptions:
    curve_keys: Path | None = None  # a `kvdrain keys` directory
    token: str | None = None  # loopback only: the PLAIN password every client must give
    insecure: bool = False  # serve beyond loopback without keys (warned about)

    def __post_init__(self) -> None:
        if self.curve_keys is not None and self.token is not None:
            raise AuthError(
                "--curve-keys and --token: give one (CURVE authenticates clients itself)"
            )
        if self.token == "":
            raise AuthError("--token: must not be empty")


def is_loopback(address: str) -> bool:
    """ipc/inproc, or tcp on 127.0.0.0/8, ::1 or localhost; anything else leaves the machine."""
    if address.startswith(LOCAL_SCHEMES):
        return True
    if not address.startswith("tcp://"):
        return False
    host = address[len("tcp://") :].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a host name: not provably local


def generate_keys(directory: Path) -> list[Path]:
    """A server and a client CURVE pair in directory (made 0700); never overwrites."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    names = [
        directory / f"{who}.{ext}" for who in (SERVER, CLIENT) for ext in ("key", "key_secret")
    ]
    existing = [str(p) for p in names if p.exists()]
    if existing:
        raise AuthError(f"keys exist already, not overwritten: {', '.join(existing)}")
    for who in (SERVER, CLIENT):
        _, secret = zmq.auth.create_certificates(directory, who)
        os.chmod(secret, 0o600)
    return names


def load_pair(directory: Path, who: str) -> tuple[bytes, bytes]:
    """(public, secret) from DIR/<who>.key_secret; AuthError if missing or unreadable."""
    path = directory / f"{who}.key_secret"
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise AuthError(
            f"--curve-keys {directory}: cannot read {path.name} ({e}); "
            f"`kvdrain keys {directory}` makes one"
        ) from None
    if secret is None:
        raise AuthError(f"--curve-keys {directory}: {path.name} holds no secret key")
    return public, secret


def load_public(directory: Path, who: str) -> bytes:
    path = directory / f"{who}.key"
    try:
        return zmq.auth.load_certificate(path)[0]
    except (OSError, ValueError) as e:
        raise AuthError(f"--curve-keys {directory}: cannot read {path.name} ({e})") from None


def check_listen(address: str, auth: AuthOptions) -> list[str]:
    """Refuse (AuthError) a serve beyond loopback without keys; the warnings to print."""
    if is_loopback(address):
        return []
    if auth.token is not None:
        raise AuthError(
            f"--token: loopback only (PLAIN sends it in clear); {address} "
            f"leaves this machine: use --curve-keys DIR"
        )
    if auth.curve_keys is not None:
        return []
    if not auth.insecure:
        raise AuthError(
            f"--address {address} listens beyond this machine: give --curve-keys DIR "
            f"(`kvdrain keys DIR` makes them) or, knowingly, --insecure"
        )
    return [
        f"WARNING: --insecure: {address} accepts requests from anyone who can reach it, "
        f"with no credential"
    ]


def secure_server(socket: zmq.Socket, auth: AuthOptions) -> ThreadAuthenticator | None:
    """Set socket (before bind) to require the credentials; the authenticator to stop at close."""
    if auth.curve_keys is None and auth.token is None:
        return None
    if auth.curve_keys is not None:
        public, secret = load_pair(auth.curve_keys, SERVER)
    authenticator = ThreadAuthenticator(socket.context)
    authenticator.start()
    if auth.curve_keys is not None:
        authenticator.configure_curve(domain="*", location=str(auth.curve_keys))
        socket.curve_secretkey, socket.curve_publickey = secret, public
        socket.curve_server = True
    else:
        authenticator.configure_plain(domain="*", passwords={TOKEN_USER: auth.token})
        socket.plain_server = True
    return authenticator


def secure_client(socket: zmq.Socket, auth: AuthOptions | None) -> None:
    """Give socket (before connect) the client's credentials, if any."""
    if auth is None:
        return
    if auth.curve_keys is not None:
        public, secret = load_pair(auth.curve_keys, CLIENT)
        socket.curve_secretkey, socket.curve_publickey = secret, public
        socket.curve_serverkey = load_public(auth.curve_keys, SERVER)
    elif auth.token is not None:
        socket.plain_username, socket.plain_password = TOKEN_USER.encode(), auth.token.encode()
