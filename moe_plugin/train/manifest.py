"""manifest.json: the last file of a checkpoint folder, and the check of a folder against it.

It lists every other file with its size, and CRC-32s of everything the tensors' own sums leave out:
the whole of .metadata and meta.json, and each byte object (data positions, RNG states, the LR
schedule, ...) where DCP wrote it. The tensors need no sums of ours: DCP writes each one as a
torch.save zip record, whose members carry the CRC-32 that torch.save computes while writing
(torch.serialization.set_crc32_options; on by default). So writing the manifest reads only small
files and objects. If those CRC-32s are switched off, the shard files are summed whole instead.

verify() checks sizes, sums and every tensor record against the bytes on disk (it reads the whole
checkpoint once), so a truncated, missing or altered file is named before anything is loaded.
"""
from __future__ import annotations

import io
import json
import mmap
import zipfile
import zlib
from pathlib import Path
from typing import Dict, Optional

import torch

NAME = "manifest.json"
FORMAT = "moe_plugin checkpoint manifest v1"
SMALL_FILES = (".metadata", "meta.json")


def crc32(data) -> str:
    return f"{zlib.crc32(data):08x}"


class _Files:
    """Each file of a folder mapped once (read-only, no copy); close() when done."""

    def __init__(self, folder: Path):
        self.folder, self.maps = folder, {}

    def __getitem__(self, name: str):
        if name not in self.maps:
            with open(self.folder / name, "rb") as file:
                empty = not file.seek(0, io.SEEK_END)
                self.maps[name] = b"" if empty else mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        return self.maps[name]

    def __enter__(self) -> "_Files":
        return self

    def __exit__(self, *_) -> None:
        for data in self.maps.values():
            if isinstance(data, mmap.mmap):
                data.close()


def _storage(folder: Path):
    """DCP's metadata of the folder: (state_dict_metadata, storage_data)."""
    from torch.distributed.checkpoint import FileSystemReader
    metadata = FileSystemReader(str(folder)).read_metadata()
    return metadata.state_dict_metadata, metadata.storage_data


def write(folder: Path) -> None:
    """manifest.json of a folder whose every other file is written (DCP's shards and .metadata, meta.json)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    whole = not torch.serialization.get_crc32_options()   # no CRC-32 in the tensor records: sum the files
    files = {}
    with _Files(folder) as read:
        for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != NAME):
            files[path.name] = {"bytes": path.stat().st_size}
            if whole or path.name in SMALL_FILES:
                files[path.name]["crc32"] = crc32(read[path.name])
        described, storage = _storage(folder)
        objects = {index.fqn: crc32(read[info.relative_path][info.offset:info.offset + info.length])
                   for index, info in storage.items() if isinstance(described[index.fqn], BytesStorageMetadata)}
    manifest = {"format": FORMAT, "tensors": "files summed whole" if whole else "torch.save CRC-32 per record",
                "files": files, "objects": objects}
    (folder / NAME).write_text(json.dumps(manifest, indent=1) + "\n")


def verify(folder: Path) -> Optional[str]:
    """None for a whole checkpoint folder, else what is wrong with it, naming the file."""
    folder = Path(folder)
    if folder.name.endswith((".tmp", ".old")):
        return f"{folder} is the remains of a save that did not finish"
    path = folder / NAME
    if not path.is_file():
        return f"{path} is missing: the save did not finish (or an older moe_plugin wrote it, without checksums)"
    try:
        manifest = json.loads(path.read_text())
        files, objects, whole = manifest["files"], manifest["objects"], manifest["tensors"] == "files summed whole"
    except (ValueError, KeyError, TypeError) as error:
        return f"{path} is unreadable ({error})"
    with _Files(folder) as read:
        for name, want in files.items():
            file = folder / name
            if not file.is_file():
                return f"{file} is missing"
            if file.stat().st_size != want["bytes"]:
                return f"{file} has {file.stat().st_size} bytes, the manifest says {want['bytes']} (truncated or " \
                       f"overwritten)"
            if "crc32" in want and crc32(read[name]) != want["crc32"]:
                return f"{file} has CRC-32 {crc32(read[name])}, the manifest says {want['crc32']} (its bytes were " \
                       f"altered)"
        return None if whole else _verify_records(folder, files, objects, read)


def _verify_records(folder: Path, files: Dict[str, dict], objects: Dict[str, str], read: _Files) -> Optional[str]:
    """Every byte object against its CRC-32 in the manifest, every tensor record against its own."""
    for index, info in _storage(folder)[1].items():
        file = folder / info.relative_path
        if info.relative_path not in files:
            return f"{file} is missing from the manifest"
        record = read[info.relative_path][info.offset:info.offset + info.length]
        where = f"{file}, {index.fqn} at byte {info.offset}"
        if index.fqn in objects:
            if crc32(record) != objects[index.fqn]:
                return f"{where}: CRC-32 {crc32(record)}, the manifest says {objects[index.fqn]} (its bytes were " \
                       f"altered)"
            continue
        try:
            bad = zipfile.ZipFile(io.BytesIO(record)).testzip()
        except Exception as error:   # zipfile raises many kinds on damaged bytes
            bad = f"unreadable ({type(error).__name__}: {error})"
        if bad is not None:
            return f"{where}: its torch.save record fails its CRC-32 check ({bad}) (its bytes were altered)"
    return None
