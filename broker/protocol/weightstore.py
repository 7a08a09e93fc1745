"""The weight store: one immutable folder per published version.

Layout of ``<root>/v000012/`` (Hugging Face layout plus a manifest):
    config.json, tokenizer files, model.safetensors (or shards), manifest.json
and with LoRA adapters published alone, adapter_config.json and adapter_model.safetensors (PEFT's
layout), beside the model's files in the version that carries the base, alone in the others.

``manifest.json`` = ``{"version": 12, "files": {"<name>": "<sha256 hex>", ...}}`` covering every
other file. A reader trusts nothing beyond the manifest (:func:`verify`): each name is a plain file
name of the version folder (no ``/``, no ``..``), no entry of the folder is a symbolic link, a folder
holding anything the manifest does not list (an extra ``.safetensors``) is refused, and so is an
empty manifest; with the store's root given, the version folder itself must be one of the root's.
The version's *hash* is the sha256 of the manifest's canonical JSON (sorted keys, no spaces). A
snapshot is written under a temporary name and renamed when complete, and is announced only after
the rename, so a reader never sees a half-written version. The writer may hand :func:`seal` the
digests it computed while writing (the weight files: hashed from the bytes it wrote, never read back);
``seal`` hashes the other, small files itself.

:func:`check` reads each file once: the sha256 of the file and, for ``.safetensors`` files when asked,
the digest of the tensors they hold (broker/protocol/tensordigest.py), from the same chunks, so that a
generator compares what it loads with the digest announced for the version (docs/weights.md). With
``keep`` it hands back what it hashed, for the engine to load: each ``.safetensors`` file mapped (the
hashes read the mapping), every other file's bytes (read once, hashed, kept): check and load are one
read of one open file, so a file renamed into the folder after the check is never what is loaded.

No torch here: the learner writes the files, this module seals, verifies and prunes them.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from broker.protocol import tensordigest

MANIFEST = "manifest.json"
INDEX = "model.safetensors.index.json"  # the Hugging Face index of a model's safetensors files
# a LoRA adapter in PEFT's layout (learner.lora.publish; docs/weights.md, "LoRA adapters"): its settings, and its
# tensors named base_model.model.<module>.lora_A.weight / lora_B
ADAPTER_CONFIG, ADAPTER_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
ADAPTER_SETTINGS = ("r", "lora_alpha", "target_modules")  # fix the adapters' shapes and scale: no version changes them


def is_adapter_tensor(name: str) -> bool:
    """A LoRA factor (``...lora_A...`` or ``...lora_B...``), in peft's in-memory or file naming."""
    return ".lora_A." in name or ".lora_B." in name


CHUNK = 1 << 22  # bytes read at a time while hashing (memory stays bounded whatever the file size)
MAX_HEADER = 100 << 20  # a safetensors header larger than this is refused (safetensors' own bound)
MAX_KEPT_FILE = 256 << 20  # a file other than .safetensors kept in memory by check(keep=True): configs, tokenizers
# safetensors' dtype names -> torch's (the names in the tensor digest)
SAFETENSORS_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
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


def seal(root: str | Path, version: int, staging: Path, known: dict[str, str] | None = None) -> tuple[Path, str]:
    """Write the manifest into ``staging``, rename it to its version folder, return (path, hash).
    ``known``: {file name: sha256 hex} the writer computed from the bytes it wrote; the other files
    are hashed here."""
    known = known or {}
    files = {
        p.name: known.get(p.name) or sha256_file(p)
        for p in sorted(staging.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    stray = set(known) - set(files)
    if stray:
        raise WeightStoreError("missing_file", f"{staging} lacks {sorted(stray)[0]}, whose digest the writer gave")
    if not files:
        raise WeightStoreError("empty_snapshot", f"{staging} holds no files")
    manifest = {"version": version, "files": files}
    # no fsync: the guarantee is against a killed process (the page cache outlives it; the rename below is
    # what makes a version appear, whole). An fsync here made ext4 flush the whole version's data with its
    # journal (up to a second per GB, on the publisher's path) and still promised nothing for the data files
    # after a power loss: a torn file is refused by every generator's hash check, and a resumed learner
    # publishes again from its checkpoint.
    with open(staging / MANIFEST, "w") as f:
        json.dump(manifest, f, sort_keys=True, indent=1)
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


def plain_name(name) -> bool:
    """Whether a manifest entry is a plain file name of its version folder (no path, not the manifest)."""
    return isinstance(name, str) and name not in ("", ".", "..", MANIFEST) and not any(c in name for c in "/\\\0")


def _check_names(path: Path, files: dict) -> None:
    """Every manifest name is a plain file name of ``path``; nothing unlisted or linked lies there."""
    if not files:
        raise WeightStoreError("empty_manifest", f"{path / MANIFEST} lists no file")
    for name in files:
        if not plain_name(name):
            raise WeightStoreError("bad_name", f"{path / MANIFEST} lists {name!r}: not a plain file name of the folder")
    for entry in path.iterdir():
        if entry.is_symlink():
            raise WeightStoreError("symlink", f"{entry} is a symbolic link; a snapshot holds only plain files")
        if entry.name != MANIFEST and entry.name not in files:
            raise WeightStoreError(
                "unlisted_file",
                f"{entry} is not listed in the manifest; a snapshot holds only the files its manifest lists",
            )


class TensorHasher:
    """The per-tensor hash (tensordigest.py, ``algorithm``) of a safetensors file fed in order, chunk by
    chunk (the same chunks as the file's sha256): the 8-byte little-endian header length, the JSON header
    (dtype, shape, data_offsets of each tensor), then the data, each tensor's range hashed apart. Entries
    for tensordigest.combine with the same algorithm."""

    def __init__(self, name: str, algorithm: str = tensordigest.DEFAULT):
        self.name, self.pos, self.head, self.algorithm = name, 0, b"", algorithm
        self.tensors: list[tuple[int, int, str, str, list[int]]] | None = None  # (begin, end, name, dtype, shape)
        self.data_start = 0
        self.entries: list[tuple[str, bytes]] = []
        self._i, self._h = 0, None

    def _bad(self, why: str) -> WeightStoreError:
        return WeightStoreError("bad_safetensors", f"{self.name}: {why}")

    def _parse(self) -> None:
        (n,) = struct.unpack("<Q", self.head[:8])
        header = json.loads(self.head[8 : 8 + n])
        if not isinstance(header, dict):
            raise self._bad("the header is not a JSON object")
        tensors = []
        for tname, info in header.items():
            if tname == "__metadata__":
                continue
            try:
                dtype = SAFETENSORS_DTYPES[info["dtype"]]
                shape = [int(x) for x in info["shape"]]
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise self._bad(f"tensor {tname!r} has no valid dtype/shape/data_offsets ({e!r})") from None
            if not 0 <= begin <= end:
                raise self._bad(f"tensor {tname!r} has data_offsets {begin}, {end}")
            tensors.append((begin, end, tname, dtype, shape))
        tensors.sort()
        for (b0, e0, n0, *_), (b1, *_rest) in zip(tensors, tensors[1:]):
            if b1 < e0:
                raise self._bad(f"tensor {n0!r} overlaps the next one")
        self.tensors, self.data_start = tensors, 8 + n

    def update(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while len(view):
            if self.tensors is None:  # still in the header
                if len(self.head) < 8:
                    take = min(8 - len(self.head), len(view))
                else:
                    need = 8 + struct.unpack("<Q", self.head[:8])[0]
                    if need > MAX_HEADER:
                        raise self._bad(f"a header of {need} bytes")
                    take = min(need - len(self.head), len(view))
                self.head += bytes(view[:take])
                view, self.pos = view[take:], self.pos + take
                if len(self.head) >= 8 and len(self.head) == 8 + struct.unpack("<Q", self.head[:8])[0]:
                    try:
                        self._parse()
                    except (json.JSONDecodeError, UnicodeDecodeError) as e:
                        raise self._bad(f"the header is not JSON ({e})") from None
                continue
            off = self.pos - self.data_start  # offset in the data section of view[0]
            while (
                self._i < len(self.tensors)
                and self.tensors[self._i][1] <= off
                and self._h is None
                and self.tensors[self._i][0] == self.tensors[self._i][1]
            ):
                self._finish_empty()
            if self._i >= len(self.tensors):
                return  # trailing bytes: not part of any tensor (the file's sha256 still covers them)
            begin, end = self.tensors[self._i][:2]
            if off < begin:  # a gap before the next tensor
                skip = min(begin - off, len(view))
                view, self.pos = view[skip:], self.pos + skip
                continue
            if self._h is None:
                self._h = tensordigest.hasher(self.algorithm)
            take = min(end - off, len(view))
            self._h.update(view[:take])
            view, self.pos = view[take:], self.pos + take
            if off + take == end:
                self._close()

    def _finish_empty(self) -> None:
        self._h = tensordigest.hasher(self.algorithm)
        self._close()

    def _close(self) -> None:
        _, _, tname, dtype, shape = self.tensors[self._i]
        self.entries.append(tensordigest.tensor_entry_from_hash(tname, dtype, shape, self._h.digest()))
        self._i, self._h = self._i + 1, None

    def finish(self) -> list[tuple[str, bytes]]:
        if self.tensors is None:
            raise self._bad("the file ends inside its header")
        while (
            self._i < len(self.tensors)
            and self.tensors[self._i][0] == self.tensors[self._i][1]
            and self.pos - self.data_start >= self.tensors[self._i][1]
        ):
            self._finish_empty()
        if self._i < len(self.tensors):
            raise self._bad(f"the file ends inside tensor {self.tensors[self._i][2]!r}")
        return self.entries


def safetensors_entries(
    data: bytes, name: str = "<bytes>", algorithm: str = tensordigest.DEFAULT
) -> list[tuple[str, bytes]]:
    """The tensor-digest entries of a whole safetensors file held in memory (see :class:`TensorHasher`)."""
    h = TensorHasher(name, algorithm)
    h.update(data)
    return h.finish()


class MappedFile:
    """A safetensors file of a verified version, mapped read-only: the bytes its sha256 and digest were
    computed from (:func:`check` with ``keep``). Load the tensors from here, not from the path: a file
    swapped in under the same name after the check (a rename into the folder) is not what this maps.
    ``tensors``: (begin, end, name, safetensors dtype name, shape) with absolute byte offsets."""

    def __init__(self, name: str, mapping: mmap.mmap, tensors: list[tuple[int, int, str, str, list[int]]]):
        self.name, self.mapping, self.tensors = name, mapping, tensors

    def close(self) -> None:
        _unmap(self.mapping)


def _unmap(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:  # a view still exported (a tensor over it): unmapped once that is gone
        pass


def _keep_bytes(f: Path) -> tuple[str, list, None, bytes | None, WeightStoreError | None]:
    """A file that is not safetensors, for ``keep``: its bytes, read once, hashed and kept."""
    with open(f, "rb") as fh:
        data = fh.read(MAX_KEPT_FILE + 1)
    if len(data) > MAX_KEPT_FILE:
        raise WeightStoreError(
            "file_too_large",
            f"{f}: more than {MAX_KEPT_FILE >> 20} MiB in a file other than "
            ".safetensors (kept in memory between its check and its load)",
        )
    return hashlib.sha256(data).hexdigest(), [], None, data, None


def _hash_file(
    f: Path, tensors: str | None, keep: bool = False
) -> tuple[str, list[tuple[str, bytes]], MappedFile | None, bytes | None, WeightStoreError | None]:
    """(sha256 hex of the file, its tensor-digest entries with the algorithm ``tensors`` when one is
    given, with ``keep`` the file mapped (:class:`MappedFile`; a file other than safetensors: its bytes),
    and the file's safetensors problem if its tensors were asked for and it has one) from one read. With
    ``keep`` the hashes read the mapping itself, so what is loaded from it later is what was hashed. The
    sha256 is always finished: a file that differs from its manifest is ``corrupt_file`` whatever its
    header looks like."""
    if keep and not f.name.endswith(".safetensors"):
        return _keep_bytes(f)
    h = hashlib.sha256()
    th = TensorHasher(f.name, tensors or tensordigest.DEFAULT) if tensors or keep else None
    problem: WeightStoreError | None = None
    with open(f, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if keep and size:
            mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            view = memoryview(mapping)
            chunks = (view[i : i + CHUNK] for i in range(0, size, CHUNK))
        else:
            mapping = None
            chunks = iter(lambda: fh.read(CHUNK), b"")
        for chunk in chunks:
            h.update(chunk)
            if th is not None and problem is None:
                try:
                    th.update(chunk)
                except WeightStoreError as e:
                    problem = e.with_traceback(None)  # its frames would hold views of the mapping
        del chunks
        if mapping is not None:
            view.release()
    entries: list[tuple[str, bytes]] = []
    if th is not None and problem is None:
        try:
            entries = th.finish()
        except WeightStoreError as e:
            problem = e.with_traceback(None)
    mapped = None
    if keep and problem is None:
        if mapping is None:  # an empty file: nothing to map, and no tensor to load from it
            problem = WeightStoreError("bad_safetensors", f"{f}: the file is empty")
        else:
            mapped = MappedFile(
                f.name,
                mapping,
                [(b + th.data_start, e + th.data_start, n, d, shape) for b, e, n, d, shape in th.tensors],
            )
    if mapped is None and mapping is not None:
        _unmap(mapping)
    return h.hexdigest(), (entries if tensors else []), mapped, None, problem


def map_written(fh, name: str) -> MappedFile:
    """A safetensors file just written and hashed through the open file ``fh`` (generators/weight_fetch.py),
    mapped from that same open file: what is loaded is the inode whose bytes were hashed, whatever is renamed
    over its name since. Only the header is parsed (no second pass over the data); WeightStoreError
    ``bad_safetensors`` when it is not a safetensors file whose tensors lie inside it."""
    fh.flush()
    size = os.fstat(fh.fileno()).st_size
    if size < 8:
        raise WeightStoreError("bad_safetensors", f"{name}: {size} bytes")
    mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        th = TensorHasher(name)
        (n,) = struct.unpack("<Q", mapping[:8])
        if n > MAX_HEADER or 8 + n > size:
            raise WeightStoreError("bad_safetensors", f"{name}: a header of {n} bytes in a {size}-byte file")
        try:
            th.head = bytes(mapping[: 8 + n])
            th._parse()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightStoreError("bad_safetensors", f"{name}: the header is not JSON ({e})") from None
        if th.tensors and th.data_start + th.tensors[-1][1] > size:
            raise WeightStoreError("bad_safetensors", f"{name}: its tensors end past the file's {size} bytes")
        return MappedFile(
            name, mapping, [(b + th.data_start, e + th.data_start, n_, d, shape) for b, e, n_, d, shape in th.tensors]
        )
    except BaseException:
        _unmap(mapping)
        raise


@dataclass
class Verified:
    """What :func:`check` found: the manifest, and the tensor digest of the version's ``.safetensors``
    files (None when not asked for)."""

    manifest: dict
    digest: str | None
    files: dict[str, MappedFile] = field(default_factory=dict)  # with ``keep``: each .safetensors file, mapped
    blobs: dict[str, bytes] = field(default_factory=dict)  # with ``keep``: every other file's bytes, as hashed

    def close(self) -> None:
        for m in self.files.values():
            m.close()


def verify(path: str | Path, expected_hash: str | None = None, root: str | Path | None = None) -> dict:
    """Check a snapshot file by file against its manifest (and the manifest against the announced
    hash): only listed plain files, none missing or altered, nothing else in the folder, and with
    ``root`` the folder inside that store. Returns the manifest; raises WeightStoreError naming the
    first problem."""
    return check(path, expected_hash, root).manifest


def check(
    path: str | Path,
    expected_hash: str | None = None,
    root: str | Path | None = None,
    expected_digest: str | None = None,
    tensor_digest: bool = False,
    threads: int = 1,
    keep: bool = False,
) -> Verified:
    """:func:`verify`, and with ``tensor_digest`` (or an ``expected_digest``) the digest of the tensors
    of the version's ``.safetensors`` files, computed from the same single read of each file (with the
    algorithm ``expected_digest`` names; the default one without it); a digest other than
    ``expected_digest`` raises WeightStoreError ``digest_mismatch`` (a file altered and its manifest
    recomputed: the hash matches, the tensors are not the ones published). ``threads``: files read and
    hashed side by side (weights.hash_threads). ``keep``: the ``.safetensors`` files stay mapped
    (``Verified.files``; close them with ``Verified.close``) and the others' bytes are kept
    (``Verified.blobs``), to be loaded from the bytes checked."""
    tensor_digest = tensor_digest or bool(expected_digest)
    algorithm = tensordigest.algorithm_of(expected_digest) if expected_digest else tensordigest.DEFAULT
    path = Path(path) if root is None else check_in_store(path, root)
    if Path(path).is_symlink():
        raise WeightStoreError("symlink", f"{path} is a symbolic link; a version folder is a plain folder")
    manifest = read_manifest(path)
    if expected_hash is not None and manifest_hash(manifest) != expected_hash:
        raise WeightStoreError(
            "hash_mismatch", f"{path}: manifest hash differs from the announced {expected_hash[:12]}"
        )
    _check_names(path, manifest["files"])
    for name in manifest["files"]:
        if not (path / name).is_file():
            raise WeightStoreError("missing_file", f"{path / name} is listed in the manifest but missing")

    def one(name: str) -> tuple[str, list[tuple[str, bytes]], MappedFile | None, bytes | None, WeightStoreError | None]:
        st = name.endswith(".safetensors")
        return _hash_file(path / name, algorithm if tensor_digest and st else None, keep)

    names = sorted(manifest["files"], key=lambda n: -(path / n).stat().st_size)  # the largest files start first
    # files hashed side by side (hashlib and xxhash release the GIL): a version in several shards is checked
    # in about the time of its largest shard when cores are free
    with ThreadPoolExecutor(max(1, min(threads, len(names))), thread_name_prefix="relay-verify") as pool:
        futures = {name: pool.submit(one, name) for name in names}
    found, problem = {}, None
    for name in names:
        try:
            found[name] = futures[name].result()
        except (WeightStoreError, OSError, ValueError) as e:
            problem = problem or e
    verified = Verified(
        manifest,
        None,
        {n: m for n, (_, _, m, _, _) in found.items() if m is not None},
        {n: b for n, (_, _, _, b, _) in found.items() if b is not None},
    )
    try:
        if problem is not None:  # a file that could not be read
            raise problem
        entries: list[tuple[str, bytes]] = []
        for name, digest in manifest["files"].items():  # the first problem in the manifest's order
            actual, tensors, _, _, bad = found[name]
            if actual != digest:
                raise WeightStoreError("corrupt_file", f"{path / name}: sha256 {actual[:12]} != manifest {digest[:12]}")
            if bad is not None:  # as the manifest says, and not a safetensors file
                raise bad
            entries.extend(tensors)
        if not tensor_digest:
            return verified
        try:
            verified.digest = tensordigest.combine(entries, algorithm)
        except ValueError as e:
            raise WeightStoreError("bad_safetensors", f"{path}: {e}") from None
        if expected_digest and verified.digest != expected_digest:
            raise WeightStoreError(
                "digest_mismatch",
                f"{path}: the tensors' digest {verified.digest[:12]} differs from the announced {expected_digest[:12]}",
            )
        return verified
    except BaseException:
        verified.close()  # nothing stays mapped for a version refused
        raise


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
