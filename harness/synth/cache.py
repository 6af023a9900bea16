"""Building a synthetic case once and caching it: ``<cache>/synth/<name>-<sha12>/``.

A case directory holds the spec, the HF checkpoint (:mod:`.hf`), one GGUF per file type
(:mod:`.gguf`) and, written last, ``manifest.json``. It is built in a temporary sibling and renamed
into place, so an interrupted or concurrent build never leaves a partial case under the final name.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..core.paths import cache_root
from .gguf import write_gguf
from .hf import write_hf
from .spec import Spec, load_spec
from .weights import make_weights

#: Bumped whenever the bytes this module writes for an unchanged spec change.
BUILDER_VERSION = "synth-2"


@dataclass(frozen=True)
class BuiltCase:
    """A built synthetic case on disk.

    Attributes:
        spec: the spec it was built from.
        root: the case directory ``<cache>/<name>-<sha12>/``.
        hf_dir: HF checkpoint directory (``config.json``, ``model.safetensors``).
        gguf: qtype (one of :data:`QTYPES`) -> path of the GGUF file.
    """

    spec: Spec
    root: Path
    hf_dir: Path
    gguf: dict[str, Path] = field(default_factory=dict)


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    return Path(cache_dir) if cache_dir is not None else cache_root() / "synth"


def case_key(spec: Spec) -> str:
    """Cache directory name of a spec: ``<name>-<sha12>``.

    ``sha12`` is the first 12 hex digits of SHA-256 over :data:`BUILDER_VERSION`
    and the spec file's SHA-256, so editing the spec or the builder starts a new
    case directory.
    """
    h = hashlib.sha256(f"{BUILDER_VERSION}\n{spec.sha256}\n".encode()).hexdigest()
    return f"{spec.name}-{h[:12]}"


def _built_case(spec: Spec, root: Path) -> BuiltCase:
    return BuiltCase(spec=spec, root=root, hf_dir=root / "hf",
                     gguf={q: root / f"{spec.name}-{q}.gguf" for q in spec.qtypes})


def _versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for pkg in ("numpy", "torch", "transformers", "gguf", "safetensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:  # pragma: no cover
            out[pkg] = "?"
    return out


def build_case(spec: Spec, out_dir: str | os.PathLike[str]) -> BuiltCase:
    """Build one case into ``out_dir`` (no caching, no atomic rename).

    Writes ``spec.toml`` (a byte copy of the spec), ``hf/`` (:func:`write_hf`),
    ``<name>-<QTYPE>.gguf`` for every qtype in :data:`QTYPES`
    (:func:`write_gguf`) and, last, ``manifest.json`` (builder version, spec
    sha256, file sha256s, package versions, build seconds).

    Raises:
        RuntimeError: a writer's self-check failed, or the spec file no longer
            has ``spec.sha256``.
    """
    t0 = time.perf_counter()
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    raw = spec.path.read_bytes()
    if hashlib.sha256(raw).hexdigest() != spec.sha256:
        raise RuntimeError(f"{spec.path}: spec file changed since it was loaded")
    (root / "spec.toml").write_bytes(raw)
    weights = make_weights(spec)
    case = _built_case(spec, root)
    write_hf(spec, weights, case.hf_dir)
    for q, p in case.gguf.items():
        write_gguf(spec, weights, p, q)
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            files[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    manifest = {
        "builder_version": BUILDER_VERSION,
        "name": spec.name,
        "spec_sha256": spec.sha256,
        "seed": spec.seed,
        "n_tensors": len(weights),
        "files": files,
        "versions": _versions(),
        "build_seconds": round(time.perf_counter() - t0, 3),
    }
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return case


def ensure_built(spec_or_path: Spec | str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None) -> BuiltCase:
    """Return the built case of a spec, building it on a cache miss.

    The case lives in ``<root>/<name>-<sha12>/`` (:func:`case_key`) where
    ``<root>`` is ``cache_dir`` if given, else ``$G4H_CACHE/synth`` if that
    variable is set, else ``~/.cache/gemma4-harness/synth`` (:func:`harness.core.paths.cache_root`).
    A case directory counts as built when its ``manifest.json`` exists. A miss builds into a fresh
    ``.tmp-*`` directory beside it and renames that into place in one step, so an
    interrupted or concurrent build never leaves a partial case under the final
    name; when two builders race, the loser discards its copy and uses the
    winner's.

    Args:
        spec_or_path: a :class:`Spec` or a spec file path.
        cache_dir: override of the cache root (see above).

    Returns:
        The :class:`BuiltCase` (HF dir and one GGUF per :data:`QTYPES`).

    Raises:
        SpecError: the spec file is invalid.
        RuntimeError: a writer's self-check failed.
    """
    spec = spec_or_path if isinstance(spec_or_path, Spec) else load_spec(spec_or_path)
    final = build_atomically(_cache_root(cache_dir), case_key(spec), lambda tmp: build_case(spec, tmp))
    return _built_case(spec, final)


def build_atomically(root: Path, key: str, build) -> Path:
    """``root/key``, built by ``build(tmp_dir)`` on a miss into a ``.tmp-*`` sibling and renamed into place.

    A directory counts as built when its ``manifest.json`` exists (``build`` writes it last). When two builders
    race, the loser discards its copy and uses the winner's.
    """
    final = root / key
    if (final / "manifest.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale_tmp(root, final.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "manifest.json").is_file():
                # A directory without a manifest under the final name is not ours to
                # keep (it cannot come from this builder); replace it.
                if final.exists():
                    shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _clean_stale_tmp(root: Path, key: str, max_age_s: float = 3600.0) -> None:
    now = time.time()
    for p in root.glob(f".tmp-{key}-*"):
        try:
            if now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass
