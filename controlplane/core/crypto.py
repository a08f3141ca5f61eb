"""Field encryption at rest with Fernet (AES-128-CBC + HMAC-SHA256, from `cryptography`).

The key is settings.FIELD_ENCRYPTION_KEY (a urlsafe-base64 32-byte Fernet key) or, when unset, one derived
from SECRET_KEY with SHA-256, so rotating SECRET_KEY without setting FIELD_ENCRYPTION_KEY makes stored
secrets unreadable (decrypt raises ValueError).
"""

import base64
import hashlib

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings


def _fernet() -> Fernet:
    key = settings.FIELD_ENCRYPTION_KEY
    if not key:
        digest = hashlib.sha256(f"kvfleet-field-encryption:{settings.SECRET_KEY}".encode()).digest()
        key = base64.urlsafe_b64encode(digest).decode()
    return Fernet(key)


def encrypt_text(plain: str) -> str:
    return _fernet().encrypt(plain.encode()).decode() if plain else ""


def decrypt_text(token: str) -> str:
    if not token:
        return ""
    try:
        return _fernet().decrypt(token.encode()).decode()
    except InvalidToken as exc:
        raise ValueError(
            "stored secret cannot be decrypted with the configured FIELD_ENCRYPTION_KEY"
        ) from exc
