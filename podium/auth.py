"""The cluster token and TLS settings every Podium service and client uses.

Arguments travel pickled, so whoever can call a worker can run code there.
Every gRPC call therefore carries the cluster token (``authorization: Bearer
<token>`` metadata), checked in constant time before any handler runs, and
mutual TLS is one option away (:class:`TlsConfig`).

Where the token comes from, first match wins: the explicit argument, the
``PODIUM_TOKEN`` environment variable, the file named by ``PODIUM_TOKEN_FILE``,
then ``~/.podium/token``. A service started with ``create=True`` writes a fresh
random token to that file (mode 0600) when none exists.
"""

from __future__ import annotations

import dataclasses
import hmac
import os
import pathlib
import secrets

from podium.errors import AuthenticationError, InvalidArgumentError
from podium.private import private_dir

#: gRPC metadata key carrying the token.
TOKEN_METADATA_KEY = "authorization"
_BEARER = "Bearer "


def default_token_file() -> pathlib.Path:
    """The token file used when no token is given: $PODIUM_TOKEN_FILE or ~/.podium/token."""
    explicit = os.environ.get("PODIUM_TOKEN_FILE")
    return pathlib.Path(explicit) if explicit else pathlib.Path.home() / ".podium" / "token"


def resolve_token(token: str | None = None, token_file: str | os.PathLike | None = None,
                  *, create: bool = False) -> str:
    """Find the cluster token (see the module docstring for the order).

    With ``create`` a missing token file is created with a new random token,
    readable by its owner only. Raises AuthenticationError when there is none.
    """
    if token:
        return token
    if os.environ.get("PODIUM_TOKEN"):
        return os.environ["PODIUM_TOKEN"]
    path = pathlib.Path(token_file) if token_file else default_token_file()
    if path.exists():
        value = path.read_text().strip()
        if value:
            return value
    if not create:
        raise AuthenticationError(
            f"no cluster token: pass token=..., set PODIUM_TOKEN, or create {path}")
    private_dir(path.parent)  # 0700: the token's folder also holds the state file and logs
    value = secrets.token_urlsafe(32)
    # O_EXCL: two services starting at once must not overwrite each other's token.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return resolve_token(token_file=path)
    with os.fdopen(fd, "w") as handle:
        handle.write(value + "\n")
    return value


def token_matches(expected: str, presented: str | None) -> bool:
    """Constant-time comparison of a presented token against the expected one."""
    if not presented:
        return False
    return hmac.compare_digest(expected.encode(), presented.encode())


def bearer(token: str) -> str:
    """The metadata value for a token."""
    return _BEARER + token


def token_from_metadata(metadata) -> str | None:
    """Extract the bearer token from gRPC invocation metadata (pairs or objects with key/value)."""
    for item in metadata or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key == TOKEN_METADATA_KEY and isinstance(value, str) and value.startswith(_BEARER):
            return value[len(_BEARER):]
    return None


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """Mutual TLS material: this side's certificate and key, and the CA that signs peers.

    Servers with a CA require and verify client certificates; clients verify
    the server against the CA and present their own certificate.
    """

    cert: str
    key: str
    ca: str
    #: Name the client expects in the server certificate (default: from the address).
    server_name: str | None = None

    @classmethod
    def from_paths(cls, cert: str | None, key: str | None, ca: str | None,
                   server_name: str | None = None) -> "TlsConfig | None":
        """Build from CLI flags (or PODIUM_TLS_* variables); all three or none must be
        given, and they must load (see :meth:`check`). ``server_name`` defaults to
        ``$PODIUM_TLS_SERVER_NAME``: one name every certificate carries, for clusters whose
        addresses no certificate can list (pods on Kubernetes)."""
        given = [cert, key, ca]
        if not any(given):
            return None
        if not all(given):
            raise InvalidArgumentError("--tls-cert, --tls-key and --tls-ca go together: give all three")
        server_name = server_name or os.environ.get("PODIUM_TLS_SERVER_NAME") or None
        return cls(cert=str(cert), key=str(key), ca=str(ca), server_name=server_name).check()

    def check(self) -> "TlsConfig":
        """Self, once the files are readable PEM and the key belongs to the certificate.

        Raises InvalidArgumentError naming the file; otherwise grpc fails much later,
        with "cannot bind" or a handshake error that names nothing.
        """
        import ssl

        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            try:
                pathlib.Path(path).read_bytes()
            except OSError as exc:
                raise InvalidArgumentError(f"{flag} {path}: {exc.strerror or exc}") from None
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except ssl.SSLError as exc:
            raise InvalidArgumentError(
                f"--tls-cert {self.cert} / --tls-key {self.key}: not a PEM certificate and its "
                f"private key ({exc.reason or exc})") from None
        try:
            ctx.load_verify_locations(cafile=self.ca)
        except ssl.SSLError as exc:
            raise InvalidArgumentError(f"--tls-ca {self.ca}: not a PEM CA certificate "
                                       f"({exc.reason or exc})") from None
        return self

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return (pathlib.Path(self.cert).read_bytes(), pathlib.Path(self.key).read_bytes(),
                pathlib.Path(self.ca).read_bytes())

    def server_credentials(self):
        """grpc.ServerCredentials requiring client certificates signed by the CA."""
        import grpc

        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                           require_client_auth=True)

    def channel_credentials(self):
        """grpc.ChannelCredentials presenting this side's certificate."""
        import grpc

        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                            certificate_chain=cert)

    def ssl_context(self, *, server: bool):
        """An ssl.SSLContext for the HTTP endpoints (server) or HTTP clients."""
        import ssl

        purpose = ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH
        ctx = ssl.create_default_context(purpose, cafile=self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        if server:
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx
