"""KT-SFT's `kt_adapter_manifest.json`: the adapter's files and the checkpoint it was trained on.

kt-kernel's SFT (`kt_kernel/sft/artifacts.py: save_kt_adapter_artifacts`) writes it beside the PEFT files and
`fused_expert_lora.safetensors`:

    {"version": 1, "status": "ready", "expert_weight_format": "mxfp4" | "int8" | ...,
     "base": {"model_name_or_path": "/models/DeepSeek-V4-Flash", "fingerprint": "<sha256>"},
     "lora": {"rank": 16, "alpha": 32.0},
     "artifacts": {"adapter_config.json": {"size", "sha256"}, "adapter_model.safetensors": {...},
                   "fused_expert_lora.safetensors": {"size", "sha256", "tensor_count", "tensors"}}, ...}

The base fingerprint is kt-kernel's identity of the source checkpoint. For DeepSeek-V4's native MXFP4
training (`kt_kernel/sft/deepseek_v4.py: inspect_native_checkpoint`) it is the SHA-256 of the canonical JSON
of {config.json's SHA-256, model.safetensors.index.json's SHA-256, one record per shard: name, size, header
SHA-256, SHA-256 of 8 sampled 64 KiB payload windows, and the file's device / inode / ctime}; for the INT8
path it is `sha256("kt-source-checkpoint-v2\\0" config_sha256 "\\0" index_sha256)`. Both are computed here for
the served checkpoint; the adapter is accepted when either equals the manifest's. The native identity ties
the fingerprint to the very files KT-SFT read; a copy of the checkpoint (another inode) is accepted when
the non-expert cache manifest that KT-SFT recorded (`non_expert_cache.path`) is readable and its portable
part (hashes, sizes, samples) matches the served files."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.lora.adapter import AdapterFormatError
from engines.lora.files import AdapterFiles

FILE = "kt_adapter_manifest.json"
_INDEX = "model.safetensors.index.json"
_SAMPLE_BYTES, _SAMPLES = 64 * 1024, 8  # kt-kernel's sampled shard identity


@dataclass(frozen=True, slots=True)
class CheckpointBinding:
    """The checkpoint an adapter was trained on, as its KT manifest records it."""

    manifest: str  # the manifest's path, for messages
    model_name_or_path: str
    fingerprint: str | None
    cache_manifest: str | None  # KT-SFT's non-expert cache manifest (kt_non_expert_manifest.json), if recorded
    lora_rank: int | None
    lora_alpha: float | None


def read(directory: Path, files: AdapterFiles = AdapterFiles()) -> CheckpointBinding | None:
    """The manifest of `directory` (None when it has none), its artifact sizes and SHA-256s checked."""
    path = directory / FILE
    if not files.has(path):
        return None
    try:
        payload = json.loads(files.open_path(path).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterFormatError(f"{path} cannot be read: {exc}") from None
    if not isinstance(payload, dict) or payload.get("version") != 1 or payload.get("status") != "ready":
        raise AdapterFormatError(f"{path}: expected a KT adapter manifest with version 1 and status 'ready' "
                                 f"(an interrupted save leaves it otherwise)")
    artifacts = payload.get("artifacts")
    if not isinstance(artifacts, dict) or not artifacts:
        raise AdapterFormatError(f"{path}: artifacts must be an object naming the adapter's files")
    for name, record in artifacts.items():
        if not isinstance(record, dict) or name != os.path.basename(name):
            raise AdapterFormatError(f"{path}: artifacts.{name} is not a file record")
        real = files.open_path(directory / name) if files.has(directory / name) else None
        if real is None:
            raise AdapterFormatError(f"{path} lists {name}, which the adapter directory lacks")
        if record.get("size") != real.stat().st_size or record.get("sha256") != sha256_file(real):
            raise AdapterFormatError(f"{path}: {name} does not match its recorded size / SHA-256 (changed after "
                                     f"the manifest was written?)")
    base, lora = payload.get("base"), payload.get("lora") or {}
    if not isinstance(base, dict) or not isinstance(base.get("model_name_or_path"), str):
        raise AdapterFormatError(f"{path}: base.model_name_or_path is missing")
    fingerprint = base.get("fingerprint")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise AdapterFormatError(f"{path}: base.fingerprint must be a SHA-256 string")
    cache = payload.get("non_expert_cache") or {}
    cache_path = cache.get("path") if isinstance(cache, dict) and isinstance(cache.get("path"), str) else None
    rank, alpha = lora.get("rank"), lora.get("alpha")
    return CheckpointBinding(str(path), base["model_name_or_path"], fingerprint,
                             str(Path(cache_path) / "kt_non_expert_manifest.json") if cache_path else None,
                             rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
                             float(alpha) if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) else None)


def check(binding: CheckpointBinding, checkpoint: Path, adapter_path: str) -> None:
    """AdapterFormatError naming both checkpoints unless `binding` is the served `checkpoint`."""
    checkpoint = Path(checkpoint)
    if binding.fingerprint is None:  # trained without a KT load plan: only the path was recorded
        if os.path.realpath(binding.model_name_or_path) == os.path.realpath(checkpoint):
            return
        served = "path " + str(checkpoint)
    else:
        identity = native_identity(checkpoint, with_files=True)
        if binding.fingerprint in (_canonical(identity), _int8_fingerprint(identity)):
            return
        if _portable(identity) == _recorded_portable(binding):
            return  # the same files, copied elsewhere
        served = f"{checkpoint} (fingerprint {_canonical(identity)[:12]})"
    raise AdapterFormatError(
        f"{adapter_path}: {FILE} binds this adapter to the checkpoint {binding.model_name_or_path}"
        f"{f' (fingerprint {binding.fingerprint[:12]})' if binding.fingerprint else ''}, but this server serves "
        f"{served}: an adapter fine-tuned on another checkpoint would change its outputs silently")


# ----------------------------------------------------------------------------------- kt-kernel's identity
def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(8 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def native_identity(checkpoint: Path, with_files: bool) -> dict[str, Any]:
    """{config_sha256, index_sha256, shards} as kt-kernel's `inspect_native_checkpoint` records them."""
    index_path = checkpoint / _INDEX
    if not index_path.is_file():
        return {"config_sha256": sha256_file(checkpoint / "config.json"), "index_sha256": None, "shards": []}
    index = json.loads(index_path.read_text())
    shards = [_shard_record(checkpoint / name, with_files) for name in sorted(set(index["weight_map"].values()))]
    return {"config_sha256": sha256_file(checkpoint / "config.json"), "index_sha256": sha256_file(index_path),
            "shards": shards}


def _shard_record(path: Path, with_files: bool) -> dict[str, Any]:
    with open(path, "rb") as handle:
        stat = os.fstat(handle.fileno())
        header_size = int.from_bytes(handle.read(8), "little")
        header = handle.read(header_size)
        start = 8 + header_size
        payload = stat.st_size - start
        window = min(_SAMPLE_BYTES, payload)
        offsets = {start}
        if payload > window:
            offsets.update(start + (payload - window) * i // (_SAMPLES - 1) for i in range(_SAMPLES))
        sample = hashlib.sha256()
        for offset in sorted(offsets):
            handle.seek(offset)
            sample.update(str(offset - start).encode() + b"\0" + handle.read(window))
    record = {"name": path.name, "size": stat.st_size, "header_sha256": hashlib.sha256(header).hexdigest(),
              "sample_sha256": sample.hexdigest()}
    if with_files:
        record["file_identity"] = {"device": stat.st_dev, "inode": stat.st_ino, "ctime_ns": stat.st_ctime_ns}
    return record


def _canonical(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _int8_fingerprint(identity: dict) -> str | None:
    if identity["index_sha256"] is None:
        return None
    digest = hashlib.sha256(b"kt-source-checkpoint-v2\0")
    digest.update(identity["config_sha256"].encode() + b"\0" + identity["index_sha256"].encode())
    return digest.hexdigest()


def _portable(identity: dict) -> dict:
    return {**identity, "shards": [{k: v for k, v in s.items() if k != "file_identity"} for s in identity["shards"]]}


def _recorded_portable(binding: CheckpointBinding) -> dict | None:
    """The portable part of the source identity KT-SFT's non-expert cache manifest recorded, if readable."""
    if binding.cache_manifest is None or not os.path.isfile(binding.cache_manifest):
        return None
    try:
        source = json.loads(Path(binding.cache_manifest).read_text()).get("source") or {}
    except (OSError, ValueError):
        return None
    identity = source.get("identity") if source.get("fingerprint") == binding.fingerprint else None
    return _portable(identity) if isinstance(identity, dict) and "shards" in identity else None
