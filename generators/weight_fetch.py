"""The ``http`` weight transport, generator side: fetch an announced version from the learner's weight
server (learner/weight_server.py) into a local cache, checking it as it arrives, then load it. The server
is the one the generator's config names (``weights.transport.advertise_url``, or ``host`` and a fixed
``port``), whatever URL an announcement names.

:meth:`WeightFetcher.fetch` downloads ``manifest.json`` first and checks it against the hash in the
signed announcement (``weightstore.manifest_hash``), then streams each file the manifest lists into a
staging folder of the cache, hashing while downloading: each file's sha256 and, from the same bytes,
the digest of its tensors (``weightstore.TensorHasher``; ``digests[version]``, which the generator
compares with the announced digest). A connection that drops (or times out)
mid-file is resumed with a Range request from the last byte written, up to ``attempts`` times per
file with back-off; a file whose sha256 differs from the manifest's is refused (``corrupt_file``)
without waiting for the load. The complete folder is renamed to ``<cache>/v000012``, so the cache,
like the store, never holds a half version; the generator then loads it as from the store, without
reading it a second time (a version already in the cache is checked again in one read before reuse).

Failures are WeightStoreError with a reason, which generators/weights.py handles as for the store:
``not_found`` (404: the version was pruned, i.e. superseded: the newer one is fetched), ``hash_mismatch``
and ``corrupt_file`` (refused, never retried), ``unauthorized`` (401: the token is not the run's),
``fetch_failed`` (the server unreachable or too slow after every attempt).

The cache keeps the newest ``keep`` fetched versions plus the one served; the default cache is a
private temporary folder (mode 0700) removed when the process exits.
"""

from __future__ import annotations

import atexit
import hashlib
import http.client
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from broker.protocol import tensordigest, weightstore
from broker.protocol.messages import Announcement
from broker.protocol.weights_config import HttpTransport
from broker.runtime.config import ConfigError
from broker.protocol.weightauth import bearer_token
from generators.transports import ReceiverContext, Receiving

log = logging.getLogger("relay.generator.weight_fetch")

CHUNK = 1 << 20
MAX_MANIFEST = 16 << 20  # a manifest lists file names and hashes: kilobytes
_RETRYABLE = (OSError, http.client.HTTPException)


class _Dropped(Exception):
    """The connection ended before the bytes the server announced."""


class WeightFetcher:
    """Fetches announced versions into ``cache`` (``cfg.cache_dir``, or a private temporary folder).

    ``token``: the bearer token of the run's weight server (broker/protocol/weightauth.py, from the
    run's weights key), None with ``weights.auth = "insecure"``. Versions are fetched from ``cfg.base_url()``
    only (the configured server): an announcement's ``url`` says a version is served, never where from. ``timeout_s``: per connection and per read; ``attempts``: the
    tries per file (a drop resumes where it stopped; back-off 0.2 s doubling, at most 5 s)."""

    def __init__(
        self,
        cfg: HttpTransport,
        token: str | None = None,
        keep: int = 3,
        timeout_s: float = 30.0,
        attempts: int = 5,
    ):
        self.base_url = cfg.base_url()
        if not self.base_url:
            raise ConfigError(
                "weights.transport = 'http': a generator fetches only from the learner's configured "
                "weight server, never from whatever URL an announcement names: set weights.transport."
                "advertise_url (or weights.transport.host and a fixed weights.transport.port) to the learner's "
                "(relay up sets it)"
            )
        if cfg.cache_dir:
            self.cache = Path(cfg.cache_dir).resolve()
            self.cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        else:
            self.cache = Path(tempfile.mkdtemp(prefix="relay-weights-")).resolve()  # mode 0700
            atexit.register(shutil.rmtree, self.cache, ignore_errors=True)
        self.token, self.keep, self.timeout_s, self.attempts = token, keep, timeout_s, attempts
        self.fetched = 0  # versions downloaded
        self.fetched_bytes = 0
        self.resumed = 0  # Range requests after a dropped connection
        # version -> the digest of its tensors, computed from the bytes as they were downloaded (or from the
        # cached folder's one read): WeightApplier compares it with the announced digest, no second read
        self.digests: dict[int, str | None] = {}

    def fetch(self, a: Announcement, serving: int | None = None) -> Path:
        """The local folder of version ``a`` (downloaded unless already cached and intact); the cache is
        pruned to the newest ``keep`` versions plus ``serving``. Raises WeightStoreError."""
        return self.fetch_kept(a, serving)[0]

    def fetch_kept(
        self, a: Announcement, serving: int | None = None, keep: bool = False
    ) -> tuple[Path, weightstore.Verified | None]:
        """:meth:`fetch`, and with ``keep`` what was hashed, for the engine to load (weightstore.Verified,
        closed by the caller): each safetensors file mapped from the very open file it was written and hashed
        through, the other files' bytes as they were hashed. No second read of the weights."""
        if not a.url:
            raise weightstore.WeightStoreError(
                "no_url",
                f"version {a.version} was announced without a URL (the learner's weights.transport is not http)",
            )
        url = self.url(a.version)  # the configured server's, never the announced one: the URL only says it is served
        final = weightstore.version_dir(self.cache, a.version)
        if final.is_dir():
            try:
                v = weightstore.check(final, a.hash, self.cache, tensor_digest=bool(a.digest), keep=keep)
                self.digests[a.version] = v.digest
                return final, (v if keep else None)
            except weightstore.WeightStoreError as e:
                log.warning("cached version %d is not intact (%s): fetching it again", a.version, e)
                shutil.rmtree(final)
        t0, nbytes = time.perf_counter(), 0
        staging = self.cache / f".fetch-v{a.version:06d}-{os.getpid()}"
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(mode=0o700)
        kept = weightstore.Verified({}, None) if keep else None
        try:
            raw = self._get_small(url, weightstore.MANIFEST)
            try:
                manifest = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise weightstore.WeightStoreError("bad_manifest", f"{url}{weightstore.MANIFEST}: {e}") from None
            if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
                raise weightstore.WeightStoreError("bad_manifest", f"{url}{weightstore.MANIFEST} has no 'files' map")
            if weightstore.manifest_hash(manifest) != a.hash:
                raise weightstore.WeightStoreError(
                    "hash_mismatch",
                    f"{url}{weightstore.MANIFEST}: manifest hash differs from the announced {a.hash[:12]}",
                )
            for name in manifest["files"]:
                if not weightstore.plain_name(name):
                    raise weightstore.WeightStoreError(
                        "bad_name", f"{url}{weightstore.MANIFEST} lists {name!r}: not a plain file name"
                    )
            (staging / weightstore.MANIFEST).write_bytes(raw)
            entries: list[tuple[str, bytes]] = []
            algorithm = tensordigest.algorithm_of(a.digest) if a.digest else None  # the one the announcement used
            for name, digest in manifest["files"].items():
                got, found = self._get_file(url, name, staging / name, digest, algorithm, kept)
                nbytes += got
                entries.extend(found)
            if kept is not None:
                kept.manifest = manifest
            try:
                tensors = tensordigest.combine(entries, algorithm) if algorithm else None  # nothing to compare it with
            except ValueError as e:
                raise weightstore.WeightStoreError("bad_safetensors", f"{url}: {e}") from None
            os.rename(staging, final)
            self.digests[a.version] = tensors
        except BaseException:
            if kept is not None:
                kept.close()
            raise
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
        dt = time.perf_counter() - t0
        self.fetched += 1
        self.fetched_bytes += nbytes
        log.info("fetched version %d over http: %.1f MB in %.2fs from %s", a.version, nbytes / 1e6, dt, url)
        self.prune({a.version} | ({serving} if serving is not None else set()))
        return final, kept

    def url(self, version: int) -> str:
        """The base URL of version ``version``'s files on the configured server (learner/weight_server.py ``url``)."""
        return f"{self.base_url}/v{version:06d}/"

    def prune(self, keep_also: set[int]) -> list[int]:
        """Delete cached versions older than the newest ``keep`` that are not in ``keep_also``."""
        versions = weightstore.list_versions(self.cache)
        doomed = [v for v in versions[: -self.keep] if v not in keep_also]
        for v in doomed:
            shutil.rmtree(weightstore.version_dir(self.cache, v), ignore_errors=True)
        for v in [v for v in self.digests if v not in versions or v in doomed]:
            del self.digests[v]
        return doomed

    # -- HTTP ---------------------------------------------------------------------------------------------

    def _request(self, url: str, name: str, start: int = 0, method: str = "GET"):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise weightstore.WeightStoreError("bad_url", f"announced URL {url!r} is not an http(s) URL")
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname, parts.port, timeout=self.timeout_s)
        headers = {"Accept-Encoding": "identity"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        if start:
            headers["Range"] = f"bytes={start}-"
        conn.request(method, parts.path.rstrip("/") + "/" + name, headers=headers)
        resp = conn.getresponse()
        if resp.status in (200, 206):
            return conn, resp
        body = resp.read(4096)
        conn.close()
        where = f"{url}{name}"
        if resp.status == 404:
            raise weightstore.WeightStoreError("not_found", f"{where}: 404 (pruned, or never published)")
        if resp.status in (401, 403):
            raise weightstore.WeightStoreError(
                "unauthorized",
                f"{where}: {resp.status} (the run's bearer token is "
                "derived from its weights key, weights.key_file: is it the same key?)",
            )
        if resp.status == 416:
            raise _Dropped(f"{where}: 416 for a resume at byte {start}: {body[:200]!r}")
        raise _Dropped(f"{where}: HTTP {resp.status} {body[:200]!r}")

    def _retrying(self, what: str, attempt_fn):
        delay, last = 0.2, None
        for i in range(self.attempts):
            try:
                return attempt_fn(i)
            except (_Dropped, *_RETRYABLE) as e:
                last = e
                log.warning("%s: attempt %d of %d failed (%s: %s)", what, i + 1, self.attempts, type(e).__name__, e)
                if i + 1 < self.attempts:
                    time.sleep(delay)
                    delay = min(delay * 2, 5.0)
        raise weightstore.WeightStoreError(
            "fetch_failed", f"{what}: {self.attempts} attempts failed, the last: {type(last).__name__}: {last}"
        )

    def _get_small(self, url: str, name: str) -> bytes:
        def attempt(_):
            conn, resp = self._request(url, name)
            try:
                data = resp.read(MAX_MANIFEST + 1)
            finally:
                conn.close()
            if len(data) > MAX_MANIFEST:
                raise weightstore.WeightStoreError("bad_manifest", f"{url}{name} is larger than {MAX_MANIFEST} bytes")
            if resp.length:
                raise _Dropped(f"connection closed with {resp.length} bytes of {name} still to come")
            return data

        return self._retrying(f"{url}{name}", attempt)

    def _get_file(
        self,
        url: str,
        name: str,
        dest: Path,
        digest: str,
        tensors: str | None,
        kept: weightstore.Verified | None = None,
    ) -> tuple[int, list[tuple[str, bytes]]]:
        """Stream ``name`` into ``dest`` hashing as it comes (the file's sha256 and, with ``tensors`` (a
        tensor digest algorithm) for a ``.safetensors`` file, its tensors' digest entries); resume from the
        last byte after a drop. Returns (bytes, entries). With ``kept``: the file, once its sha256 checks,
        goes into it (a safetensors file mapped through the open file that wrote it, another file's bytes)."""
        safetensors = name.endswith(".safetensors")
        dl = _Download(dest, tensors if safetensors else None, keep_bytes=kept is not None and not safetensors)
        try:

            def attempt(i: int) -> None:
                if i and dl.got:
                    self.resumed += 1
                    log.info("%s%s: resuming at byte %d", url, name, dl.got)
                conn, resp = self._request(url, name, start=dl.got)
                try:
                    if dl.got and resp.status != 206:  # the server ignored the range: start over
                        dl.restart()
                    left = resp.length  # bytes still to come (None: until the connection closes)
                    while left is None or left > 0:
                        chunk = resp.read(CHUNK if left is None else min(CHUNK, left))
                        if not chunk:
                            break
                        dl.write(chunk)
                        if left is not None:
                            left -= len(chunk)
                    if left:
                        raise _Dropped(f"connection closed with {left} bytes of {name} still to come")
                finally:
                    conn.close()

            self._retrying(f"{url}{name}", attempt)
            actual = dl.hash.hexdigest()
            if actual != digest:
                raise weightstore.WeightStoreError(
                    "corrupt_file", f"{url}{name}: sha256 {actual[:12]} != manifest {digest[:12]}"
                )
            if kept is not None and safetensors:
                kept.files[name] = weightstore.map_written(dl.out, name)
            elif kept is not None:
                kept.blobs[name] = bytes(dl.kept)
        finally:
            dl.out.close()
        return dl.got, (dl.tensors.finish() if dl.tensors is not None else [])


class _Download:
    """One file being downloaded: the bytes written so far, their running sha256 and (``tensors``: a
    safetensors file) the running digest of its tensors; with ``keep_bytes`` (a small file the engine will
    load) the bytes themselves."""

    def __init__(self, dest: Path, tensors: str | None, keep_bytes: bool = False):
        self.out = open(dest, "w+b")  # read back through this same open file (weightstore.map_written)
        self.name, self.algorithm, self.keep_bytes = dest.name, tensors, keep_bytes
        self.restart()

    def write(self, chunk: bytes) -> None:
        self.out.write(chunk)
        self.hash.update(chunk)
        if self.keep_bytes:
            self.kept += chunk
        if self.tensors is not None:
            self.tensors.update(chunk)
        self.got += len(chunk)

    def restart(self) -> None:
        self.out.seek(0)
        self.out.truncate()
        self.kept = bytearray()
        self.hash = hashlib.sha256()
        self.tensors = weightstore.TensorHasher(self.name, self.algorithm) if self.algorithm else None
        self.got = 0


def receiving(ctx: ReceiverContext) -> Receiving:
    """``weights.transport = "http"``, generator side (generators/transports.py): versions fetched from the
    learner's configured weight server, with the run's bearer token."""
    return Receiving(fetcher=WeightFetcher(ctx.cfg.weights.transport, bearer_token(ctx.weights_key, ctx.cfg.run_id)))
