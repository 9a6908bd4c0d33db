"""The cluster's shared secret, using Ray's own token authentication (Ray >= 2.52).

How Ray reads it (checked against ray 2.60's `_private/authentication` and `scripts.py`):
- `RAY_AUTH_MODE=token` turns authentication on; it is read from the environment of every Ray process, so
  it must be set where `ray start` runs, on every node, and for every driver that connects.
- The token comes from, in this order: `RAY_AUTH_TOKEN` (the value), `RAY_AUTH_TOKEN_PATH` (a file; unreadable
  or empty is fatal), `~/.ray/auth_token`. Ray generates tokens as `secrets.token_hex(32)`.
- `ray start --head` turns token mode on by itself only when the mode is unset and a token exists; a worker
  or a driver given an explicit address never does, so we always set the mode explicitly.
- HTTP (dashboard, job API) takes the token as `Authorization: Bearer <token>`.

fleetrl passes the token to Ray as a file path (RAY_AUTH_TOKEN_PATH) whenever it has one, so the value
stays out of process environments and logs; it is only ever printed masked.
"""
from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, MutableMapping

from fleetrl.errors import UserError

TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
MODE_ENV = "RAY_AUTH_MODE"


class TokenMissingError(UserError, RuntimeError):
    """Raised when a node that must join a token-protected cluster has no token."""


class TokenRejectedError(UserError, RuntimeError):
    """The head refused the token this node or driver holds (or that it holds none)."""


@dataclass(frozen=True, slots=True)
class ClusterToken:
    value: str
    path: Path | None
    """File the token was read from or written to; None when it came from RAY_AUTH_TOKEN."""
    origin: str
    """Where it came from, for messages: "--token-file /x", "RAY_AUTH_TOKEN", ..."""

    @property
    def masked(self) -> str:
        return mask(self.value)


def mask(token: str) -> str:
    """First 4 characters and an ellipsis; the only form in which a token is ever shown."""
    return token[:4] + "…"


def default_token_path() -> Path:
    """Ray's default location (~/.ray/auth_token); on a shared home every node sees it."""
    return Path.home() / ".ray" / "auth_token"


def find_token(env: Mapping[str, str], token_file: Path | None = None) -> ClusterToken:
    """The token a joining node or a client uses: --token-file, then Ray's own order.

    Raises TokenMissingError naming every place that was looked at.
    """
    if token_file is not None:
        return _read(Path(token_file), f"--token-file {token_file}")
    if env.get(TOKEN_ENV):
        return ClusterToken(env[TOKEN_ENV].strip(), None, TOKEN_ENV)
    if env.get(TOKEN_PATH_ENV):
        return _read(Path(env[TOKEN_PATH_ENV]), f"{TOKEN_PATH_ENV}={env[TOKEN_PATH_ENV]}")
    default = default_token_path()
    if default.is_file() and default.read_text().strip():
        return _read(default, str(default))
    raise TokenMissingError(
        "no cluster auth token found on this node. The head wrote it when it started (see the join command "
        f"it printed); make it available here as one of: --token-file PATH (a file on a shared filesystem), "
        f"{TOKEN_ENV}=<token>, {TOKEN_PATH_ENV}=PATH, or the file {default}")


def find_token_or_none(env: Mapping[str, str], token_file: Path | None = None) -> ClusterToken | None:
    """Like find_token, for clients of clusters that may run without authentication."""
    try:
        return find_token(env, token_file)
    except TokenMissingError:
        return None


def create_or_reuse_token(env: Mapping[str, str], token_file: Path | None = None) -> ClusterToken:
    """The head's token: an existing one (same order as find_token), else a new one at --token-file or
    ~/.ray/auth_token, written with mode 0600."""
    if token_file is None:
        found = find_token_or_none(env)
        if found is not None:
            return found
        token_file = default_token_path()
    token_file = Path(token_file)
    if token_file.is_file() and token_file.read_text().strip():
        return _read(token_file, str(token_file))
    token_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = token_file.with_name(token_file.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))  # Ray's own format: 256 random bits, hex
    os.replace(tmp, token_file)  # atomic: a worker polling the shared path never reads half a token
    return _read(token_file, f"new token at {token_file}")


def apply_token_env(env: MutableMapping[str, str], token: ClusterToken) -> None:
    """Sets the variables that make a Ray process (ray start, a driver) use `token`."""
    env[MODE_ENV] = "token"
    if token.path is not None:
        env.pop(TOKEN_ENV, None)  # would take precedence over the path
        env[TOKEN_PATH_ENV] = str(token.path.resolve())
    else:
        env.pop(TOKEN_PATH_ENV, None)
        env[TOKEN_ENV] = token.value


def http_headers(token: ClusterToken | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token.value}"} if token is not None else {}


def _read(path: Path, origin: str) -> ClusterToken:
    try:
        value = path.read_text().strip()
    except OSError as e:
        raise TokenMissingError(f"cannot read the cluster auth token from {origin}: {e.strerror}; the head "
                                f"writes it there when it starts, so check the path is on a filesystem "
                                f"this node shares with the head") from e
    if not value:
        raise TokenMissingError(f"the cluster auth token file {path} ({origin}) is empty")
    return ClusterToken(value, path, origin)


# Ray answers a wrong or missing token only after its own connection retries (a worker's `ray start`: 23 s and
# InvalidAuthToken on line 25 of 26; a driver: a 95-line ConnectionError after 26 s that never names the token).
# One unary call to the GCS answers UNAUTHENTICATED in milliseconds.
CHECK_TIMEOUT_S = 5.0


def head_requires(address: str, token: ClusterToken | None, timeout_s: float = CHECK_TIMEOUT_S) -> bool | None:
    """Whether the GCS at HOST:PORT accepts a call carrying `token` (None: no token at all): True when it answers,
    False when it refuses it as unauthenticated, None when it cannot be asked (unreachable, TLS, too slow), which
    is left to Ray's own connection and its errors."""
    import grpc  # deferred, as ray itself: most commands never connect
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    metadata = [("authorization", f"Bearer {token.value}")] if token is not None else []
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s, metadata=metadata)
            return True
        except grpc.RpcError as e:
            return False if e.code() == grpc.StatusCode.UNAUTHENTICATED else None


def check_token(address: str, token: ClusterToken | None, timeout_s: float = CHECK_TIMEOUT_S) -> bool:
    """Returns whether the cluster at `address` (HOST:PORT of its GCS) wants a token (then `token` is the right
    one); TokenRejectedError, one line naming the token and the fix, when `token` is missing or wrong."""
    if head_requires(address, None, timeout_s) is not False:
        return False  # no token needed, or the head cannot be asked: Ray's own connection decides
    if token is None:
        raise TokenRejectedError(
            f"the Ray cluster at {address} requires an auth token, and none was found here (looked at "
            f"{TOKEN_ENV}, {TOKEN_PATH_ENV} and {default_token_path()}). Fix: give this process the head's token: "
            f"{TOKEN_PATH_ENV}=FILE or --token-file FILE (the file the head was started with), or {TOKEN_ENV}=<token>")
    if head_requires(address, token, timeout_s) is False:
        raise TokenRejectedError(
            f"the Ray cluster at {address} refused the auth token {token.masked} from {token.origin}: it is not the "
            f"head's token (the head printed the first 4 characters of its own when it started; `fleetrl cluster "
            f"status` on the head shows them). Fix: use the head's token file (--token-file FILE or "
            f"{TOKEN_PATH_ENV}=FILE) or {TOKEN_ENV}=<token>")
    return True


def reload_ray_auth() -> None:
    """Makes an imported Ray read the auth variables again: token mode is read from the environment when Ray's
    config is built (the same refresh Ray does when it enables auth itself)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
