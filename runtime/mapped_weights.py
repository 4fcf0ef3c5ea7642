"""Stored weights as arrays over their memory-mapped blobs: what CPU sessions and device uploads read."""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pipeshard.formats.export_info import numpy_dtype
from pipeshard.formats.manifest import Weight


@dataclass
class MappedWeights:
    """Stored weights as read-only arrays over their files, each file mapped once."""

    maps: dict[Path, mmap.mmap] = field(default_factory=dict)

    def add(self, folder: Path, stored: Iterable[Weight]) -> dict[str, np.ndarray]:
        """Map a sub-layer's weights (its manifest records); returns them by name."""
        added = {}
        for weight in stored:
            path = folder / weight.file
            if path not in self.maps:
                with open(path, "rb") as file:
                    self.maps[path] = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            dtype = numpy_dtype(weight.dtype)
            added[weight.name] = np.frombuffer(
                self.maps[path], dtype, weight.bytes // dtype.itemsize, weight.offset
            ).reshape(weight.shape)
        return added

    def release_pages(self) -> None:
        """Let the kernel drop the mapped pages (read again from the files if used)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            for mapped in self.maps.values():
                mapped.madvise(mmap.MADV_DONTNEED)
