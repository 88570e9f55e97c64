"""Optional CURVE authentication and encryption for ZeroMQ sockets.

- ``generate_keypair()`` makes a Z85 key pair; ``create_keypair_files``/``load_keypair`` use
  ZeroMQ's standard certificate files (``NAME.key`` public, ``NAME.key_secret`` both keys).
- A listening (bound) socket takes ``CurveServerKeys`` (its own pair); a connecting socket takes
  ``CurveClientKeys`` (its own pair + the server's public key). A client that does not speak
  CURVE, or uses the wrong server key, never completes the handshake: no message of its ever
  reaches the server and it never gets a reply.
- ``ClientAllowList`` installs a ZAP handler on a context so that only listed client public keys
  are admitted (without one, any client that knows the server's public key is admitted).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CurveKeyPair:
    public: bytes  # Z85, 40 bytes
    secret: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class CurveServerKeys:
    keypair: CurveKeyPair


@dataclass(frozen=True, slots=True)
class CurveClientKeys:
    keypair: CurveKeyPair
    server_public: bytes


CurveKeys = CurveServerKeys | CurveClientKeys


def generate_keypair() -> CurveKeyPair:
    public, secret = zmq.curve_keypair()
    return CurveKeyPair(public=public, secret=secret)


def create_keypair_files(directory: str | Path, name: str) -> CurveKeyPair:
    """Write ``NAME.key`` and ``NAME.key_secret`` under ``directory`` and return the pair."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    _, secret_path = zmq.auth.create_certificates(str(directory), name)
    return load_keypair(secret_path)


def load_keypair(secret_path: str | Path) -> CurveKeyPair:
    path = Path(secret_path)
    if not path.is_file():
        raise FileNotFoundError(f"CURVE secret key file {path} does not exist")
    public, secret = zmq.auth.load_certificate(str(path))
    if not secret:
        raise ValueError(f"{path} holds only a public key; pass the .key_secret file")
    return CurveKeyPair(public=public, secret=secret)


def load_public_key(path: str | Path) -> bytes:
    public, _ = zmq.auth.load_certificate(str(path))
    return public


def apply_curve(sock: zmq.Socket, keys: CurveKeys | None) -> None:
    """Configure ``sock`` for CURVE before bind/connect (no-op for ``None``)."""
    if keys is None:
        return
    sock.curve_secretkey = keys.keypair.secret
    sock.curve_publickey = keys.keypair.public
    if isinstance(keys, CurveServerKeys):
        sock.curve_server = True
    else:
        sock.curve_serverkey = keys.server_public


class ClientAllowList:
    """ZAP handler admitting only the given client public keys (``None``: any CURVE client).

    One per zmq context; ``await start()`` inside the running loop, ``stop()`` when done.
    """

    def __init__(self, ctx: zmq.Context, allowed_public_keys: Iterable[bytes] | None = None):
        self._ctx = ctx
        self._allowed = None if allowed_public_keys is None else set(allowed_public_keys)
        self._auth: AsyncioAuthenticator | None = None

    async def start(self) -> None:
        self._auth = AsyncioAuthenticator(self._ctx, log=log)
        self._auth.start()
        if self._allowed is None:
            self._auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
        else:
            self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def allow(self, public_key: bytes) -> None:
        if self._allowed is not None:
            self._allowed.add(public_key)

    def revoke(self, public_key: bytes) -> None:
        if self._allowed is not None:
            self._allowed.discard(public_key)

    def callback(self, domain: str, public_key: bytes) -> bool:
        is_allowed = public_key in self._allowed
        if not is_allowed:
            log.warning("CURVE client refused: public key %s is not in the allow list", public_key.decode())
        return is_allowed

    def stop(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
