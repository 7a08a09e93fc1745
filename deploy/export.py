"""``relay export``: a published version of a run as a standard Hugging Face model folder.

The weight store's version folders already hold the Hugging Face layout (``config.json``, the
tokenizer files, ``model.safetensors``) plus ``manifest.json``. Export checks every file against the
manifest's sha256 (a corrupt or half-pruned snapshot is refused, naming the file), copies the files
into a temporary folder next to ``--out`` and renames it into place, and adds
``relay_export.json`` (run, version, the version's manifest hash, each file's sha256). The result is
what ``AutoModelForCausalLM.from_pretrained(DIR)`` and ``vllm.LLM(model=DIR)`` load as they are.

A LoRA version published as its adapter alone (learner.lora.publish, docs/weights.md "LoRA adapters")
is exported as that adapter, a PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``;
``relay_export.json`` names the version that carries its base model); with ``merged`` the export is
the base model with the adapter merged in (``W + (alpha / r) B A``, each shard in turn), a plain
Hugging Face folder, with the adapter in ``adapter/`` beside it. Only merging imports torch; the
rest copies verified files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from broker.protocol import weightstore
from broker.protocol.weightstore import ADAPTER_CONFIG, ADAPTER_FILE, INDEX, PEFT_PREFIX


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
    raise ExportError(
        f"{run!r} is not a run folder with a weight store (looked in {p} and {q}; a run folder holds weights/)"
    )


def _verified(store: Path, version: int) -> dict:
    try:
        return weightstore.verify(weightstore.version_dir(store, version))
    except weightstore.WeightStoreError as e:
        raise ExportError(f"version {version} failed verification: {e}") from None


def _copy(src: Path, dst: Path, files: dict[str, str]) -> None:
    """Copy ``files`` ({name: sha256}) from ``src`` into ``dst``, each copy checked against its sha256."""
    dst.mkdir(parents=True, exist_ok=True)
    for name, digest in sorted(files.items()):
        shutil.copyfile(src / name, dst / name)
        if weightstore.sha256_file(dst / name) != digest:  # the copy itself, checked again
            raise ExportError(f"copying {name} gave different bytes than the manifest says")


def base_version(store: Path, version: int) -> int:
    """The version whose folder carries the base model of the LoRA adapter of ``version``: the newest one up
    to it that holds model weights (each learner process publishes one first, and the store keeps it while
    adapters pin it). ExportError when none is kept."""
    for v in reversed([v for v in weightstore.list_versions(store) if v <= version]):
        if (weightstore.version_dir(store, v) / INDEX).is_file():
            return v
    raise ExportError(f"version {version} is a LoRA adapter, and no version up to it in {store} carries its base model")


def _module(factor: str) -> str:
    """An adapter file's tensor name (``base_model.model.<module>.lora_A.weight``) -> ``<module>``."""
    return factor.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0]


def _merge(base: Path, adapter: Path, out: Path) -> None:
    """Write into ``out`` the base model of folder ``base`` with the adapter of folder ``adapter`` merged into
    its weights, shard by shard (memory: one shard and the adapter), through the learner's own merge."""
    from safetensors.torch import load_file, save_file

    from learner.lora import merged_state_dict

    settings = json.loads((adapter / ADAPTER_CONFIG).read_text())
    scale = settings["lora_alpha"] / settings["r"]
    factors = load_file(str(adapter / ADAPTER_FILE))
    shards = sorted(set(json.loads((base / INDEX).read_text())["weight_map"].values()))
    merged_modules = set()
    for shard in shards:
        tensors = load_file(str(base / shard))
        mine = {k: t for k, t in factors.items() if f"{_module(k)}.weight" in tensors}
        merged_modules.update(_module(k) for k in mine)
        save_file(
            {k: t.contiguous() for k, t in merged_state_dict({**tensors, **mine}, scale).items()},
            str(out / shard),
            metadata={"format": "pt"},
        )
    every = {_module(k) for k in factors}
    if every - merged_modules:
        raise ExportError(f"the adapter has layers the base model lacks: {sorted(every - merged_modules)[:3]}")
    for f in base.iterdir():
        if f.is_file() and f.name not in (*shards, weightstore.MANIFEST, ADAPTER_CONFIG, ADAPTER_FILE):
            shutil.copyfile(f, out / f.name)


def export(
    run_dir: str | Path, out: str | Path, version: int | None = None, overwrite: bool = False, merged: bool = False
) -> dict:
    """Export ``version`` (default: the newest kept) of the run in ``run_dir`` to ``out``; return
    the export's record (also written to ``out/relay_export.json``). A LoRA adapter version: the adapter,
    or with ``merged`` the merged model (and the adapter in ``out/adapter``)."""
    run_dir, out = Path(run_dir), Path(out)
    store = run_dir / "weights"
    versions = weightstore.list_versions(store)
    if not versions:
        raise ExportError(f"{store} holds no published version")
    if version is None:
        version = versions[-1]
    if version not in versions:
        raise ExportError(
            f"version {version} is not in {store} (kept: {', '.join(map(str, versions))}; older "
            "versions are pruned, see learner.publish.keep_versions)"
        )
    src = weightstore.version_dir(store, version)
    manifest = _verified(store, version)
    occupied = (out.is_dir() and any(out.iterdir())) or (out.exists() and not out.is_dir())
    if occupied and not overwrite:
        raise ExportError(f"{out} exists and is not empty; choose another --out or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    record = {
        "run_id": run_dir.name,
        "version": version,
        "manifest_hash": weightstore.manifest_hash(manifest),
        "source": str(src),
        "files": manifest["files"],
    }
    try:
        lora = ADAPTER_CONFIG in manifest["files"]
        adapter_only = lora and INDEX not in manifest["files"]
        if not lora:
            _copy(src, tmp, manifest["files"])
        else:  # the adapter's files (a version carrying the base holds the base's too: those are not the adapter)
            adapter_files = {k: d for k, d in manifest["files"].items() if k in (ADAPTER_CONFIG, ADAPTER_FILE)}
            b = base_version(store, version) if adapter_only else version
            base_manifest = _verified(store, b) if b != version else manifest
            record["lora"] = {
                "base_version": b,
                "base_manifest_hash": weightstore.manifest_hash(base_manifest),
                "merged": merged,
            }
            _copy(src, tmp / "adapter" if merged else tmp, adapter_files)
            if merged:
                _merge(weightstore.version_dir(store, b), src, tmp)
        (tmp / "relay_export.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
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
    p.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA adapter version: write the base model with the "
        "adapter merged in (a plain Hugging Face folder), the adapter in OUT/adapter (default: the adapter "
        "alone, a PEFT folder)",
    )


def run_export(args) -> int:
    import sys

    try:
        rec = export(resolve_run(args.run, args.runs_dir), args.out, args.version, args.overwrite, args.merged)
    except ExportError as e:
        print(f"relay export: error: {e}", file=sys.stderr)
        return 2
    lora = rec.get("lora")
    what = (
        ""
        if lora is None
        else (
            " merged with its LoRA adapter"
            if lora["merged"]
            else f" (a LoRA adapter for the base model of version {lora['base_version']})"
        )
    )
    print(
        f"relay export: version {rec['version']} of run {rec['run_id']} (manifest {rec['manifest_hash'][:12]}){what} "
        f"-> {rec['path']}"
    )
    return 0
