"""``relay export``: a published version of a run as a standard Hugging Face model folder.

The weight store's version folders already hold the Hugging Face layout (``config.json``, the
tokenizer files, ``model.safetensors``) plus ``manifest.json``. Export checks every file against the
manifest's sha256 (a corrupt or half-pruned snapshot is refused, naming the file), copies the files
into a temporary folder next to ``--out`` and renames it into place, and adds
``relay_export.json`` (run, version, the version's manifest hash, each file's sha256). The result is
what ``AutoModelForCausalLM.from_pretrained(DIR)`` and ``vllm.LLM(model=DIR)`` load as they are.

No torch here: it copies verified files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from broker.protocol import weightstore


class ExportError(Exception):
    pass


def resolve_run(run: str, runs_dir: str | Path = "runs") -> Path:
    """A run folder from a path, or a run id (or ``latest``) under ``runs_dir``."""
    p = Path(run)
    if (p / "weights").is_dir():
        return p.resolve()
    q = Path(runs_dir) / run
    if (q / "weights").is_dir():
        return q.resolve()
    raise ExportError(f"{run!r} is not a run folder with a weight store (looked in {p} and {q}; a run folder holds "
                      f"weights/)")


def export(run_dir: str | Path, out: str | Path, version: int | None = None, overwrite: bool = False) -> dict:
    """Export ``version`` (default: the newest kept) of the run in ``run_dir`` to ``out``; return
    the export's record (also written to ``out/relay_export.json``)."""
    run_dir, out = Path(run_dir), Path(out)
    store = run_dir / "weights"
    versions = weightstore.list_versions(store)
    if not versions:
        raise ExportError(f"{store} holds no published version")
    if version is None:
        version = versions[-1]
    if version not in versions:
        raise ExportError(f"version {version} is not in {store} (kept: {', '.join(map(str, versions))}; older "
                          "versions are pruned, see learner.keep_versions)")
    src = weightstore.version_dir(store, version)
    try:
        manifest = weightstore.verify(src)
    except weightstore.WeightStoreError as e:
        raise ExportError(f"version {version} failed verification: {e}") from None
    occupied = (out.is_dir() and any(out.iterdir())) or (out.exists() and not out.is_dir())
    if occupied and not overwrite:
        raise ExportError(f"{out} exists and is not empty; choose another --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for name, digest in sorted(manifest["files"].items()):
        shutil.copyfile(src / name, tmp / name)
        if weightstore.sha256_file(tmp / name) != digest:  # the copy itself, checked again
            shutil.rmtree(tmp, ignore_errors=True)
            raise ExportError(f"copying {name} gave different bytes than the manifest says")
    record = {"run_id": run_dir.name, "version": version, "manifest_hash": weightstore.manifest_hash(manifest),
              "source": str(src), "files": manifest["files"]}
    (tmp / "relay_export.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    os.rename(tmp, out)
    return {**record, "path": str(out.resolve())}


def add_export_arguments(p) -> None:
    p.add_argument("run", metavar="RUN", help="a run folder (runs/<run-id>), or a run id or 'latest' under --runs-dir")
    p.add_argument("--version", type=int, default=None, help="the version to export (default: the newest kept)")
    p.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    p.add_argument("--runs-dir", default="runs", help="where run ids are looked up (default: runs)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def run_export(args) -> int:
    import sys

    try:
        rec = export(resolve_run(args.run, args.runs_dir), args.out, args.version, args.overwrite)
    except ExportError as e:
        print(f"relay export: error: {e}", file=sys.stderr)
        return 2
    print(f"relay export: version {rec['version']} of run {rec['run_id']} (manifest {rec['manifest_hash'][:12]}) "
          f"-> {rec['path']}")
    return 0
