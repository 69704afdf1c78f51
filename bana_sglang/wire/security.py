"""The cluster secret and the CurveZMQ keys of every control channel.

One secret per cluster, in a file of mode 0600 (``--cluster-secret-file``, or
one the launcher creates per run), named to every process by
``BANA_CLUSTER_SECRET_FILE``. From it each process derives, with keyed
BLAKE2b (``hashlib``), the same two CurveZMQ key pairs: the servers' and the
clients'. A :class:`~.transport.Server` is a CURVE server whose ZAP handler
(pyzmq's own :class:`zmq.auth.thread.ThreadAuthenticator`, one per ZMQ
context) accepts only the clients' public key; a :class:`~.transport.Client`
connects with the clients' pair and the servers' public key. A peer without
the secret can neither complete the handshake nor read the traffic: its
requests never reach a handler.

The same secret keys other integrity checks (:func:`derive`, one purpose
string per use), so no second secret has to be distributed.

Without ``BANA_CLUSTER_SECRET_FILE`` the transport is plain ZMQ (unit tests,
a part run by hand on loopback).
"""

from __future__ import annotations

import functools
import hashlib
import os
import secrets
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth.thread
from zmq.utils import z85

from bana_sglang import envs

#: the ZAP domain of a bana_sglang server socket: this prefix and its cluster's key
ZAP_DOMAIN = "bana"
#: the shortest secret accepted (hex characters, 128 bits)
MIN_SECRET_CHARS = 32


class SecretError(ValueError):
    """The cluster secret file is missing, too open, or too short (the message says which)."""


@dataclass(frozen=True)
class CurveKeys:
    """Both CurveZMQ key pairs of a cluster, z85-encoded."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def create_secret_file(path: str | os.PathLike) -> Path:
    """Write a new random secret (256 bits, hex) to ``path``, mode 0600, unless it exists."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return p
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return p


def read_secret(path: str | os.PathLike) -> bytes:
    """The secret in ``path``; refuses a file others can read or a short secret."""
    p = Path(path)
    try:
        st = p.stat()
        text = p.read_text().strip()
    except OSError as e:
        raise SecretError(f"cluster secret file {p}: {e.strerror or e}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(
            f"cluster secret file {p} is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run: chmod 600 {p}"
        )
    if len(text) < MIN_SECRET_CHARS:
        raise SecretError(
            f"cluster secret file {p} holds {len(text)} characters; at least "
            f"{MIN_SECRET_CHARS} are needed (python -c 'import secrets; "
            f"print(secrets.token_hex(32))' > {p})"
        )
    return text.encode()


def derive(secret: bytes, purpose: str, size: int = 32) -> bytes:
    """A key for one ``purpose`` (at most 16 bytes of ASCII), independent of every other."""
    return hashlib.blake2b(secret, digest_size=size, person=purpose.encode()).digest()


WORKER_KEY_PURPOSE = "bana-worker-key"


def worker_api_key(secret: bytes) -> str:
    """The API key the cluster's SGLang workers require (SGLang's own ``--api-key``),
    derived from the cluster secret: the router and every internal client send it,
    nobody types it, and it is never on a command line."""
    return derive(secret, WORKER_KEY_PURPOSE).hex()


def process_worker_key() -> str | None:
    """This process's cluster's worker API key, or None without a cluster secret."""
    secret = cluster_secret()
    return worker_api_key(secret) if secret else None


def worker_headers() -> dict[str, str]:
    """The ``Authorization`` header a call to a worker of this process's cluster needs
    (empty without a cluster secret)."""
    key = process_worker_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def curve_keys(secret: bytes) -> CurveKeys:
    server = z85.encode(derive(secret, "bana-zmq-server"))
    client = z85.encode(derive(secret, "bana-zmq-client"))
    return CurveKeys(zmq.curve_public(server), server, zmq.curve_public(client), client)


@functools.lru_cache(maxsize=8)
def _keys_of(path: str) -> CurveKeys:
    return curve_keys(read_secret(path))


def cluster_secret() -> bytes | None:
    """This process's cluster secret (``BANA_CLUSTER_SECRET_FILE``), or None when unset."""
    path = envs.BANA_CLUSTER_SECRET_FILE.get()
    return read_secret(path) if path else None


def process_keys() -> CurveKeys | None:
    """The CurveZMQ keys of this process's cluster, or None (plain ZMQ) when no secret is set."""
    path = envs.BANA_CLUSTER_SECRET_FILE.get()
    return _keys_of(path) if path else None


def zap_domain(keys: CurveKeys) -> str:
    """The ZAP domain of ``keys``' servers: a context serving two clusters keeps them apart."""
    return f"{ZAP_DOMAIN}.{keys.server_public[:8].decode()}"


class _AllowClient:
    """The ZAP credentials check of one domain: only its cluster's client key gets in."""

    def __init__(self, domain: str, client_public: bytes):
        self.domain, self.client_public = domain, client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return domain == self.domain and secrets.compare_digest(key, self.client_public)


_auth_lock = threading.Lock()
#: per context (by id; the context is kept alive here): its ZAP handler and the domains it checks
_authenticators: dict[int, tuple[zmq.Context, zmq.auth.thread.ThreadAuthenticator, set[str]]] = {}


def _ensure_authenticator(ctx: zmq.Context, keys: CurveKeys) -> str:
    domain = zap_domain(keys)
    with _auth_lock:
        entry = _authenticators.get(id(ctx))
        if entry is None:
            auth = zmq.auth.thread.ThreadAuthenticator(ctx)
            auth.start()
            entry = _authenticators[id(ctx)] = (ctx, auth, set())
        if domain not in entry[2]:
            entry[1].configure_curve_callback(domain, _AllowClient(domain, keys.client_public))
            entry[2].add(domain)
    return domain


def release(ctx: zmq.Context) -> None:
    """Stop ``ctx``'s ZAP handler (before ``ctx.term()``, which would wait for it)."""
    with _auth_lock:
        entry = _authenticators.pop(id(ctx), None)
    if entry is not None:
        entry[1].stop()


def secure_server(sock: zmq.Socket, ctx: zmq.Context, keys: CurveKeys) -> None:
    """Make ``sock`` (not yet bound) a CURVE server that admits only the cluster's clients."""
    sock.zap_domain = _ensure_authenticator(ctx, keys).encode()
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True


def secure_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make ``sock`` (not yet connected) a CURVE client of the cluster's servers."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
