"""Sealed reasoning: Responses' ``include: ["reasoning.encrypted_content"]``.

A stateless server cannot keep a reply's reasoning for the next turn, and OpenAI's clients (Codex) keep
reasoning items opaque: they send back ``encrypted_content`` and nothing else. So the server seals the
reasoning text into ``encrypted_content`` with authenticated encryption (AES-256-GCM, from the
``cryptography`` package), and opens it when an item comes back: the reasoning then reaches the chat
template as that turn's ``reasoning_content`` (a template that keeps past thinking, such as Kimi K2.6's,
renders it). A token that does not open (tampered, truncated, sealed under another key) is a 400.

Token: urlsafe base64 of version byte 1, a random 12-byte nonce, the ciphertext and the 16-byte tag; the
associated data binds the version and purpose. The key: ``--reasoning-seal-key`` (``reasoning_seal_key``),
else the ``DDTREE_REASONING_SEAL_KEY`` environment variable (any string, hashed with SHA-256 to the AES key:
give every replica behind a router the same one, and a long random one), else a random key per process
(items then open only on the replica that sealed them, and not after a restart).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

ENV_KEY = "DDTREE_REASONING_SEAL_KEY"
VERSION = b"\x01"
AAD = b"ddtree-serve reasoning.encrypted_content v1"
NONCE_BYTES = 12


class SealError(ValueError):
    """A sealed token that does not open."""


class ReasoningSeal:
    """Seals and opens reasoning text under one key (``ephemeral``: a random key of this process)."""

    def __init__(self, key: str | None) -> None:
        self.ephemeral = key is None
        raw = os.urandom(32) if key is None else hashlib.sha256(key.encode()).digest()
        self._aead = AESGCM(raw)

    @classmethod
    def from_config(cls, configured: str | None) -> ReasoningSeal:
        """The seal of ``--reasoning-seal-key``, else of the environment's key, else an ephemeral one."""
        return cls(configured or os.environ.get(ENV_KEY) or None)

    def seal(self, text: str) -> str:
        """The token of ``text``."""
        nonce = os.urandom(NONCE_BYTES)
        return base64.urlsafe_b64encode(VERSION + nonce + self._aead.encrypt(nonce, text.encode(), AAD)).decode()

    def open(self, token: str) -> str:
        """The text sealed in ``token``; SealError where it does not open."""
        try:
            raw = base64.urlsafe_b64decode(token.encode())
        except (binascii.Error, ValueError, UnicodeEncodeError):
            raise SealError("not a token this server sealed (not base64)") from None
        if len(raw) < 1 + NONCE_BYTES + 16 or raw[:1] != VERSION:
            raise SealError("not a token this server sealed")
        try:
            plain = self._aead.decrypt(raw[1:1 + NONCE_BYTES], raw[1 + NONCE_BYTES:], AAD)
        except InvalidTag:
            raise SealError("it does not open: altered, or sealed under another key (every replica needs the same "
                            "--reasoning-seal-key)") from None
        return plain.decode()
