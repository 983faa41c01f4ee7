"""Signed media URLs: one secret per deployment, strict tokens, rotation with a grace period.

A search result's thumbnail and file URLs carry ``?token=<expiry>.<signature>`` when search needs an API
key, because ``<img>`` and ``<video>`` elements cannot send one. Any worker or replica may get the fetch
that follows a search, so all of them must verify with the same secret (a per-process secret failed 7 of
20 fetches with two workers). The secret comes from, first found:

1. ``media_secret`` (``GARE_MEDIA_SECRET``; the compose file passes it to every replica);
2. ``media_secret_file`` (``GARE_MEDIA_SECRET_FILE``: a docker or Kubernetes secret);
3. ``<index>/.gare-media-secret``, generated once (mode 0600) by the first process that needs it and read
   by every later one: the workers of a bare ``gare-serve`` and several ``gare-serve`` on one host share it
   with no configuration. A read-only index directory without one is a startup error naming 1 and 2.

Rotation: set the new secret and move the old one to ``media_secret_previous``; tokens signed with either
verify, new tokens use the new one, and after ``media_token_ttl_s`` the previous one can be dropped.

A token is checked strictly: ASCII digits (no leading zero, at most 12) for the expiry, a dot, and the
base64url HMAC-SHA256 of ``"<video_id>:<expiry>"`` (itsdangerous). Anything else is refused (401 at the
route), never parsed further: ``int()`` accepts ``"²"`` and 4,301-digit strings raise in it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import time
from collections.abc import Sequence
from pathlib import Path

from itsdangerous import Signer

log = logging.getLogger(__name__)

SECRET_FILE = ".gare-media-secret"
MIN_SECRET_CHARS = 32
_SALT = "gare-media-url"
# expiry: 1-12 ASCII digits, no leading zero; signature: base64url of a 32-byte HMAC (43 chars, no padding)
_TOKEN = re.compile(r"([1-9][0-9]{0,11})\.([A-Za-z0-9_-]{43})", re.ASCII)

__all__ = ["MediaSecretError", "MediaSigner", "SECRET_FILE", "MIN_SECRET_CHARS", "load_or_create_secret",
           "resolve_secrets"]


class MediaSecretError(RuntimeError):
    """No usable media secret (message is meant for the operator)."""


def _checked(secret: str, where: str) -> bytes:
    s = secret.strip()
    if len(s) < MIN_SECRET_CHARS:
        raise MediaSecretError(
            f"the media URL secret from {where} has {len(s)} characters; use at least {MIN_SECRET_CHARS} "
            "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return s.encode("utf-8")


def load_or_create_secret(index_dir: str | os.PathLike) -> bytes:
    """The secret kept in ``<index_dir>/.gare-media-secret``, created (0600) if absent.

    Creation is race-free between processes: the secret is written to a private temporary file and
    ``os.link``-ed to the final name, which fails if another process got there first; then everyone reads
    the one file that won.
    """
    root = Path(index_dir)
    path = root / SECRET_FILE
    if not path.exists():
        tmp = root / f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise MediaSecretError(
                f"cannot create the media URL secret in {root} ({e.strerror or e}): the index directory is not "
                "writable here; set GARE_MEDIA_SECRET or GARE_MEDIA_SECRET_FILE to the same secret on every "
                "replica"
            ) from None
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(secrets.token_urlsafe(48) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, path)
                log.info("generated the media URL secret %s (shared by every gare-serve of this index)", path)
            except FileExistsError:
                pass  # another process created it first: use theirs
        finally:
            tmp.unlink(missing_ok=True)
    try:
        return _checked(path.read_text(encoding="utf-8"), str(path))
    except OSError as e:
        raise MediaSecretError(f"cannot read the media URL secret {path}: {e.strerror or e}") from None


def resolve_secrets(*, secret: str, secret_file: str | os.PathLike | None, previous: str,
                    index_dir: str | os.PathLike | None) -> list[bytes]:
    """[current, previous?]: the configured secret, else the secret file, else the index's own file."""
    if secret.strip():
        current = _checked(secret, "GARE_MEDIA_SECRET")
    elif secret_file is not None:
        try:
            text = Path(secret_file).read_text(encoding="utf-8")
        except OSError as e:
            raise MediaSecretError(f"cannot read the media secret file {secret_file}: {e.strerror or e}") from None
        current = _checked(text, str(secret_file))
    elif index_dir is not None:
        current = load_or_create_secret(index_dir)
    else:
        raise MediaSecretError("no media URL secret: set GARE_MEDIA_SECRET or GARE_MEDIA_SECRET_FILE")
    out = [current]
    if previous.strip():
        out.append(_checked(previous, "GARE_MEDIA_SECRET_PREVIOUS"))
    return out


class MediaSigner:
    """Signs ``(video_id, expiry)`` with the first secret; verifies with any of them (rotation)."""

    def __init__(self, keys: Sequence[bytes], ttl_s: int = 3600) -> None:
        if not keys:
            raise ValueError("MediaSigner needs at least one secret")
        self._signers = [Signer(k, salt=_SALT, digest_method=hashlib.sha256) for k in keys]
        self.ttl_s = int(ttl_s)

    @classmethod
    def ephemeral(cls, ttl_s: int = 3600) -> MediaSigner:
        """A random per-process secret: only for a service whose URLs are not signed (no key needed)."""
        return cls([secrets.token_bytes(32)], ttl_s)

    def token(self, video_id: int, now: float | None = None) -> str:
        exp = int(time.time() if now is None else now) + self.ttl_s
        return f"{exp}.{self._signers[0].get_signature(f'{video_id}:{exp}').decode('ascii')}"

    def verify(self, video_id: int, token: str | None, now: float | None = None) -> bool:
        """True only for a well-formed, unexpired token signed for this video by a current or previous secret."""
        if not token or len(token) > 64:
            return False
        m = _TOKEN.fullmatch(token)
        if m is None:
            return False
        exp_s, sig = m.groups()
        if int(exp_s) < (time.time() if now is None else now):
            return False
        msg = f"{video_id}:{exp_s}"
        return any(s.verify_signature(msg, sig) for s in self._signers)
