"""Member secrets that a restarted coordinator can check again.

A member proves who it is (Watch, Barrier, Leave, ReportFailure, re-registration) with the secret it
got when its job completed. The secret is a MAC of (job id, job incarnation, rank) under the
coordinator's key, so a coordinator restarted with the same key recognises the members of a job it
never saw, and nobody without the key can make a secret for another rank.

The key comes from what a restarted coordinator is given again: its token, or else its TLS private
key. A coordinator with neither (a loopback one for tests and single-host runs) uses a random key,
and its jobs do not outlive it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from collsvc.options import CoordinatorOptions

# Domain separation: the key is never used for anything else, and never equals the token itself.
_KEY_LABEL = b"collsvc member secret key v1"


def member_key(token: str | None = None, tls_key: bytes | None = None) -> bytes:
    """The key member secrets are made with: from the token, else the TLS key, else random.

    Args:
        token: the coordinator's shared job token, if it has one.
        tls_key: the coordinator's TLS private key (PEM bytes), if it serves TLS.
    """
    material = token.encode() if token else tls_key
    if not material:
        return secrets.token_bytes(32)
    return hmac.new(material, _KEY_LABEL, hashlib.sha256).digest()


class MemberSecrets:
    """Makes and checks member secrets under one key.

    Args:
        key: the coordinator's member key (:func:`member_key`).
        stable: whether the key survives a restart (False for a random one): a restarted coordinator
            only rebuilds jobs when it is.
    """

    def __init__(self, key: bytes, *, stable: bool = True) -> None:
        self._key = key
        self.stable = stable

    @classmethod
    def random(cls) -> MemberSecrets:
        """Secrets under a random key: nothing outlives this coordinator."""
        return cls(secrets.token_bytes(32), stable=False)

    def secret(self, job_id: str, incarnation: int, rank: int) -> str:
        """The secret of ``rank`` in this instance of job ``job_id`` (32 hex characters)."""
        message = f"{job_id}\x00{incarnation}\x00{rank}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()[:32]

    def verify(self, job_id: str, incarnation: int, rank: int, presented: str) -> bool:
        """Whether ``presented`` is the secret of ``rank`` (constant time)."""
        return hmac.compare_digest(self.secret(job_id, incarnation, rank).encode(), presented.encode())


def secrets_for(options: CoordinatorOptions) -> MemberSecrets:
    """Member secrets under a key this coordinator gets again when restarted with the same token or
    TLS key (see :func:`member_key`); a random key when it has neither."""
    tls_key = None
    if options.tls is not None:
        with open(options.tls.key, "rb") as handle:
            tls_key = handle.read()
    if not options.token and not tls_key:
        return MemberSecrets.random()
    return MemberSecrets(member_key(options.token, tls_key))
