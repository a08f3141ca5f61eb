"""What produced a worker's KV: a digest of the checkpoint's weight files plus the quantization and dtype.

The L3 namespace (:func:`engine.cache.keys.namespace_digest`) includes :func:`kv_producer`, so a worker
whose KV comes from other weights (another checkpoint served under the same name), another
``--torchao-config`` or another compute dtype never finds a page of this one in a shared store.

Hashing a checkpoint reads every byte once (SHA-256, about 1-2 GB/s); the result is cached per weight file
in a cache directory, keyed by the file's absolute path, size and modification time (nanoseconds), so a
restart or a second worker on the same host reads nothing. Directory: env ``KVFLEET_WEIGHTS_DIGEST_DIR``,
else ``~/.cache/kvfleet/weights``; a directory that cannot be written only costs the re-hash.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "KVFLEET_WEIGHTS_DIGEST_DIR"
_READ = 8 << 20


def cache_dir() -> Path:
    """Where per-file weight digests are kept (env ``KVFLEET_WEIGHTS_DIGEST_DIR`` or the user cache)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvfleet" / "weights")


def weight_files(path: str | Path) -> list[Path]:
    """The files holding a checkpoint's weights: a GGUF file itself, or an HF folder's ``*.safetensors``
    (sorted). Raises ``FileNotFoundError`` when there are none."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"{path}: no weight files to fingerprint")
    return files


def file_digest(path: Path) -> str:
    """64-hex SHA-256 of one file's bytes, read from the digest cache when its (path, size, mtime) match."""
    path = path.resolve()
    st = path.stat()
    entry_key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()
    entry = cache_dir() / f"{entry_key}.sha256"
    try:
        cached = entry.read_text().strip()
        if len(cached) == 64:
            return cached
    except OSError:
        pass
    hasher = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_READ):
            hasher.update(chunk)
    digest = hasher.hexdigest()
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(digest)
        os.replace(tmp, entry)
    except OSError as exc:
        logger.warning("weights digest of %s not cached (%s); it is recomputed at each start", path, exc)
    return digest


def weights_digest(path: str | Path) -> str:
    """64-hex digest of a checkpoint's weight files (names and contents), cached per file."""
    hasher = hashlib.sha256()
    for f in weight_files(path):
        hasher.update(f"{f.name}\0{file_digest(f)}\n".encode())
    return hasher.hexdigest()


def kv_producer(weights: str, quantization: str | None, compute_dtype: str) -> str:
    """One line naming what computes the KV: weights digest, ``--torchao-config`` (``none``) and the compute
    dtype (``bfloat16``; a ``torch.`` prefix is dropped)."""
    dtype = str(compute_dtype).removeprefix("torch.")
    return f"weights={weights};quantization={quantization or 'none'};dtype={dtype}"
