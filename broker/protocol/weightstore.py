"""The weight store: one immutable folder per published version.

Layout of ``<root>/v000012/`` (Hugging Face layout plus a manifest):
    config.json, tokenizer files, model.safetensors (or shards), manifest.json

``manifest.json`` = ``{"version": 12, "files": {"<name>": "<sha256 hex>", ...}}`` covering every
other file. A reader trusts nothing beyond the manifest (:func:`verify`): each name is a plain file
name of the version folder (no ``/``, no ``..``), no entry of the folder is a symbolic link, a folder
holding anything the manifest does not list (an extra ``.safetensors``) is refused, and so is an
empty manifest; with the store's root given, the version folder itself must be one of the root's.
The version's *hash* is the sha256 of the manifest's canonical JSON (sorted keys, no spaces). A
snapshot is written under a temporary name and renamed when complete, and is announced only after
the rename, so a reader never sees a half-written version.

No torch here: the learner writes the files, this module seals, verifies and prunes them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

MANIFEST = "manifest.json"
_VERSION_DIR = re.compile(r"^v(\d{6,})$")


class WeightStoreError(Exception):
    """A snapshot that is missing, incomplete or corrupt. ``reason`` is a short code."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_hash(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def staging_dir(root: str | Path, version: int) -> Path:
    """A fresh temporary folder to write version ``version`` into before :func:`seal`."""
    p = Path(root) / f".tmp-v{version:06d}-{os.getpid()}"
    if p.exists():
        shutil.rmtree(p)
    p.mkdir(parents=True)
    return p


def seal(root: str | Path, version: int, staging: Path) -> tuple[Path, str]:
    """Write the manifest into ``staging``, rename it to its version folder, return (path, hash)."""
    files = {
        p.name: sha256_file(p) for p in sorted(staging.iterdir()) if p.is_file() and p.name != MANIFEST
    }
    if not files:
        raise WeightStoreError("empty_snapshot", f"{staging} holds no files")
    manifest = {"version": version, "files": files}
    with open(staging / MANIFEST, "w") as f:
        json.dump(manifest, f, sort_keys=True, indent=1)
        f.flush()
        os.fsync(f.fileno())
    final = version_dir(root, version)
    if final.exists():
        raise WeightStoreError("version_exists", f"{final} already exists; versions are immutable")
    os.rename(staging, final)
    return final, manifest_hash(manifest)


def read_manifest(path: str | Path) -> dict:
    mpath = Path(path) / MANIFEST
    if not mpath.is_file():
        raise WeightStoreError("missing_manifest", f"{mpath} does not exist")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise WeightStoreError("bad_manifest", f"{mpath}: {e}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise WeightStoreError("bad_manifest", f"{mpath} has no 'files' map")
    return manifest


def check_in_store(path: str | Path, root: str | Path) -> Path:
    """``path`` resolved, when it is a version folder directly under the store ``root`` (symbolic
    links resolved first: a link out of the store is outside it); else WeightStoreError."""
    real, store = Path(path).resolve(), Path(root).resolve()
    if real.parent != store or not _VERSION_DIR.match(real.name):
        raise WeightStoreError("outside_store", f"{path} is not a version folder (vNNNNNN) of the weight store {store}")
    return real


def _check_names(path: Path, files: dict) -> None:
    """Every manifest name is a plain file name of ``path``; nothing unlisted or linked lies there."""
    if not files:
        raise WeightStoreError("empty_manifest", f"{path / MANIFEST} lists no file")
    for name in files:
        if not isinstance(name, str) or name in ("", ".", "..", MANIFEST) or "/" in name or "\\" in name \
                or "\0" in name:
            raise WeightStoreError("bad_name", f"{path / MANIFEST} lists {name!r}: not a plain file name of the folder")
    for entry in path.iterdir():
        if entry.is_symlink():
            raise WeightStoreError("symlink", f"{entry} is a symbolic link; a snapshot holds only plain files")
        if entry.name != MANIFEST and entry.name not in files:
            raise WeightStoreError("unlisted_file", f"{entry} is not listed in the manifest; a snapshot holds "
                                   f"only the files its manifest lists")


def verify(path: str | Path, expected_hash: str | None = None, root: str | Path | None = None) -> dict:
    """Check a snapshot file by file against its manifest (and the manifest against the announced
    hash): only listed plain files, none missing or altered, nothing else in the folder, and with
    ``root`` the folder inside that store. Returns the manifest; raises WeightStoreError naming the
    first problem."""
    path = Path(path) if root is None else check_in_store(path, root)
    if Path(path).is_symlink():
        raise WeightStoreError("symlink", f"{path} is a symbolic link; a version folder is a plain folder")
    manifest = read_manifest(path)
    if expected_hash is not None and manifest_hash(manifest) != expected_hash:
        raise WeightStoreError("hash_mismatch", f"{path}: manifest hash differs from the announced {expected_hash[:12]}")
    _check_names(path, manifest["files"])
    for name, digest in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise WeightStoreError("missing_file", f"{f} is listed in the manifest but missing")
        actual = sha256_file(f)
        if actual != digest:
            raise WeightStoreError("corrupt_file", f"{f}: sha256 {actual[:12]} != manifest {digest[:12]}")
    return manifest


def list_versions(root: str | Path) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _VERSION_DIR.match(p.name)))


def prune(root: str | Path, keep_last: int, in_use: set[int]) -> list[int]:
    """Delete versions older than the newest ``keep_last`` that no generator serves."""
    versions = list_versions(root)
    doomed = [v for v in versions[:-keep_last] if v not in in_use] if keep_last > 0 else []
    for v in doomed:
        shutil.rmtree(version_dir(root, v), ignore_errors=True)
    return doomed
