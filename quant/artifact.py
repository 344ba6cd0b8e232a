"""The serving artifact: safetensors files plus a JSON manifest, verified on every load.

    ARTIFACT/
      manifest.json          format + version, model / feature config, quantization scheme,
                             the training run it came from, every tensor's dtype, shape and
                             sha256, every file's sha256 and size, sizes and accuracy
      embeddings.safetensors quantized table rows (codes + per-row fp16 scale/bias) or fp16/fp32
      dense.safetensors      tower and heads (fp32 / bf16 / int8 codes + scales / fp8 + scales);
                             with a semantic-ID decoder, its weights (fp32) and codebook (int64)
      index.safetensors      optional: the catalogue's ANN index (quant/ann.py), listed and
                             hashed like the others, its build described in the manifest's ``index``

The manifest's ``generative`` says whether the model decodes semantic IDs ({} when not;
else levels, sizes, items and the default beam): what a deployer (and ModelInfo) reads
without loading tensors. Older manifests have no such key (no decoder).

Loading never unpickles anything (safetensors only) and refuses, naming the problem: an
unknown or newer format version, a missing file, a file whose checksum differs, a tensor
missing, extra, or with another dtype, shape or checksum than the manifest says. A path may
come from a request (Admin.LoadArtifact), so nothing is opened before it is known to be a
regular file of bounded size inside the artifact folder (:func:`check_artifact`): a FIFO or a
device would block the reader, a name with ``/`` or ``..`` would leave the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT = "genrec.artifact"
FORMAT_VERSION = 1
FILES = ("embeddings.safetensors", "dense.safetensors")
OPTIONAL_FILES = ("index.safetensors",)  # read by its own loader (quant.ann.load_index), not load_tensors
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20  # a manifest lists every tensor: a few hundred KB for large models
# the schemes an artifact may name (quant.embeddings.Scheme, quant.dense.Scheme: a test keeps them
# equal), here so that checking a manifest imports neither fbgemm nor torchrec
EMBEDDING_SCHEMES = ("fp32", "fp16", "int8", "int4")
DENSE_SCHEMES = ("fp32", "bf16", "int8", "fp8")
REQUIRED = ("format", "format_version", "model", "embedding", "quantization", "tensors", "files")


class ArtifactError(ValueError):
    """An artifact cannot be loaded; the message names the file / tensor and the problem."""


class OutsideRoot(ArtifactError):
    """A file of the artifact (or its folder) resolves outside the folder loads are allowed from."""


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass
class Manifest:
    model: dict[str, Any]
    embedding: dict[str, Any]
    quantization: dict[str, Any]
    source: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)
    generative: dict[str, Any] = field(default_factory=dict)  # {} without a semantic-ID decoder
    index: dict[str, Any] = field(default_factory=dict)  # {} without an ANN index (quant.ann)
    format: str = FORMAT
    format_version: int = FORMAT_VERSION
    created: str = ""


def save_artifact(out: str | Path, manifest: Manifest, tensors: dict[str, dict[str, torch.Tensor]]) -> Path:
    """Writes ``tensors`` (file name -> {tensor name -> tensor}) and the manifest to ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    manifest.created = manifest.created or time.strftime("%Y-%m-%dT%H:%M:%S%z")
    manifest.tensors, manifest.files = {}, {}
    for fname in FILES:
        group = {k: v.detach().contiguous().cpu() for k, v in tensors.get(fname, {}).items()}
        save_file(group, str(out / fname))
        manifest.tensors[fname] = {
            k: {"dtype": _dtype_name(v), "shape": list(v.shape), "sha256": tensor_sha256(v)} for k, v in group.items()
        }
        manifest.files[fname] = {"sha256": file_sha256(out / fname), "bytes": (out / fname).stat().st_size}
    (out / "manifest.json").write_text(json.dumps(manifest.__dict__, indent=2) + "\n")
    return out


def _regular_file(path: Path, what: str, max_bytes: int | None = None) -> int:
    """The size of ``path`` if it is a regular file (stat only: opening a FIFO would block)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ArtifactError(f"{path}: {what} is missing") from None
    except OSError as e:
        raise ArtifactError(f"{path}: {what} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ArtifactError(f"{path}: {what} is not a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise ArtifactError(f"{path}: {what} is {st.st_size} bytes, more than {max_bytes}")
    return st.st_size


def read_manifest(path: str | Path) -> Manifest:
    path = Path(path)
    if not path.is_dir():
        raise ArtifactError(f"{path}: not a directory; an artifact is the folder written by 'genrec quantize'")
    mpath = path / MANIFEST
    if not mpath.exists() and not mpath.is_symlink():
        raise ArtifactError(f"{path}: no {MANIFEST}; is this an artifact written by 'genrec quantize'?")
    _regular_file(mpath, MANIFEST, MAX_MANIFEST_BYTES)
    try:
        raw = json.loads(mpath.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mpath}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ArtifactError(f"{mpath}: not a JSON object")
    if raw.get("format") != FORMAT:
        raise ArtifactError(f"{mpath}: format is {str(raw.get('format'))[:64]!r}, expected {FORMAT!r}")
    version = raw.get("format_version")
    if whole(version) and version > FORMAT_VERSION:
        raise ArtifactError(
            f"{mpath}: format_version {str(version)[:32]} is newer than this genrec reads ({FORMAT_VERSION}); "
            "upgrade genrec"
        )
    if not whole(version, 1):
        raise ArtifactError(f"{mpath}: format_version {str(version)[:32]!r} is not one genrec wrote "
                            f"(1 to {FORMAT_VERSION})")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ArtifactError(f"{mpath}: lacks the key '{missing[0]}'; was it written by 'genrec quantize'?")
    for key in ("model", "embedding", "quantization", "tensors", "files", "generative", "index"):
        if not isinstance(raw.get(key, {}), dict):
            raise ArtifactError(f"{mpath}: '{key}' is not a JSON object")
    _check_quantization(mpath, raw["quantization"])
    for fname, listed in raw["tensors"].items():
        for name, want in (listed.items() if isinstance(listed, dict) else [(None, listed)]):
            ok = (isinstance(want, dict) and isinstance(want.get("shape"), list)
                  and all(whole(d) for d in want["shape"])
                  and isinstance(want.get("dtype"), str) and isinstance(want.get("sha256"), str))
            if not ok:
                what = f"tensor {str(name)[:64]!r} of {str(fname)[:64]!r}" if name is not None else f"{str(fname)[:64]!r}"
                raise ArtifactError(f"{mpath}: the entry of {what} is not {{shape: [ints], dtype, sha256}}")
    known = set(Manifest.__dataclass_fields__)
    return Manifest(**{k: v for k, v in raw.items() if k in known})


def whole(x: Any, low: int = 0) -> bool:
    """Whether a JSON value is an integer (not a bool) of at least ``low``."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _check_quantization(mpath: Path, q: dict) -> None:
    """The manifest's ``quantization``: schemes this genrec serves and a positive row alignment."""
    for key, schemes in (("embeddings", EMBEDDING_SCHEMES), ("dense", DENSE_SCHEMES)):
        if q.get(key) not in schemes:
            raise ArtifactError(f"{mpath}: quantization.{key} = {str(q.get(key))[:32]!r}; "
                                f"this genrec serves {list(schemes)}")
    align = q.get("row_alignment", 16)
    if not whole(align, 1):
        raise ArtifactError(f"{mpath}: quantization.row_alignment = {str(align)[:32]!r}; it must be a positive integer")


def _inside(path: Path, root: Path, what: str) -> None:
    """Refuses ``path`` unless it resolves (every symlink followed) below ``root`` (resolved)."""
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as e:
        raise ArtifactError(f"{path}: {what} cannot be resolved ({type(e).__name__})") from None
    if not resolved.is_relative_to(root):
        raise OutsideRoot(f"{path}: {what} resolves to {resolved}, outside the artifact root {root}; "
                          "every file of an artifact loaded from a request must lie below it (copy it there)")


def check_artifact(path: str | Path, root: str | Path | None = None) -> Manifest:
    """The manifest of ``path`` after the checks that need no tensor read: every listed file
    is one of the format's own names (no path of the manifest's choosing is ever opened), a
    regular file in the folder, of the size the manifest says; with ``root``, the folder, its
    manifest and every listed file resolve (symlinks followed) below ``root``, checked before
    each is read. Cheap (a few stat calls), so a server runs it before it starts an engine
    for a path it was handed."""
    path = Path(path)
    if root is not None:
        root = Path(root).resolve()
        _inside(path, root, "the artifact folder")
        _inside(path / MANIFEST, root, MANIFEST)
    manifest = read_manifest(path)
    for fname in manifest.files:
        if fname not in FILES + OPTIONAL_FILES:
            raise ArtifactError(f"{path / MANIFEST}: lists the file {fname[:64]!r}; an artifact holds only "
                                f"{list(FILES + OPTIONAL_FILES)}")
    if root is not None:
        for fname in manifest.files:
            _inside(path / fname, root, f"{fname} (listed in {MANIFEST})")
    for fname in FILES + tuple(f for f in OPTIONAL_FILES if f in manifest.files):
        meta = manifest.files.get(fname)
        if not isinstance(meta, dict) or not isinstance(meta.get("bytes"), int) or not isinstance(meta.get("sha256"), str):
            raise ArtifactError(f"{path / MANIFEST}: no size and checksum for {fname}")
        if not isinstance(manifest.tensors.get(fname), dict):
            raise ArtifactError(f"{path / MANIFEST}: no tensor list for {fname}")
        size = _regular_file(path / fname, fname)
        if size != meta["bytes"]:
            raise ArtifactError(f"{path / fname}: {size} bytes, the manifest says {meta['bytes']} (truncated or replaced)")
    return manifest


def load_tensors(path: str | Path, manifest: Manifest | None = None) -> tuple[Manifest, dict[str, dict[str, torch.Tensor]]]:
    """Reads and verifies every file and tensor against the manifest."""
    path = Path(path)
    manifest = check_artifact(path) if manifest is None else manifest
    out: dict[str, dict[str, torch.Tensor]] = {}
    for fname, meta in manifest.files.items():
        if fname in OPTIONAL_FILES:  # (the index: its loader verifies it, only where it is used)
            continue
        if fname not in FILES:  # (a manifest handed in unchecked): never open a name it chose
            raise ArtifactError(f"{path / MANIFEST}: lists the file {fname[:64]!r}; an artifact holds only {list(FILES)}")
        fpath = path / fname
        _regular_file(fpath, f"{fname} (listed in {MANIFEST})")
        try:
            group = load_file(str(fpath))
        except Exception as e:  # noqa: BLE001 - safetensors raises several types for a bad header
            raise ArtifactError(f"{fpath}: not a readable safetensors file ({e})") from e
        expected = manifest.tensors.get(fname, {})
        missing = sorted(set(expected) - set(group))
        extra = sorted(set(group) - set(expected))
        if missing:
            raise ArtifactError(f"{fpath}: tensor '{missing[0]}' is missing")
        if extra:
            raise ArtifactError(f"{fpath}: tensor '{extra[0]}' is not in the manifest")
        for name, t in group.items():  # tensors first, so a damaged tensor is named
            want = expected[name]
            if list(t.shape) != want["shape"]:
                raise ArtifactError(f"{fpath}: tensor '{name}' has shape {list(t.shape)}, the manifest says {want['shape']}")
            if _dtype_name(t) != want["dtype"]:
                raise ArtifactError(f"{fpath}: tensor '{name}' has dtype {_dtype_name(t)}, the manifest says {want['dtype']}")
            if tensor_sha256(t) != want["sha256"]:
                raise ArtifactError(f"{fpath}: tensor '{name}' does not match its checksum (corrupted)")
        if file_sha256(fpath) != meta["sha256"]:
            raise ArtifactError(f"{fpath}: checksum mismatch: the file was changed after export")
        out[fname] = group
    for fname in FILES:
        if fname not in out:
            raise ArtifactError(f"{path}: manifest.json lists no {fname}")
    return manifest, out
