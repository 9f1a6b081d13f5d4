"""A reproduction of how kubelet writes and updates a ConfigMap volume, for the tuning tests."""

from __future__ import annotations

import os
from pathlib import Path

from baton.common.tuning import FILE_NAME


class KubeletDir:
    """A ConfigMap volume as kubelet writes it: `..<ts>/baton.yaml`, `..data -> ..<ts>`,
    `baton.yaml -> ..data/baton.yaml`; an update renames a new `..data` over the old."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.n = 0

    def publish(self, text: str) -> None:
        self.n += 1
        ts = self.root / f"..2026_11_22_{self.n:06d}"
        ts.mkdir()
        (ts / FILE_NAME).write_text(text)
        old = os.readlink(self.root / "..data") if (self.root / "..data").is_symlink() else None
        tmp = self.root / "..data_tmp"
        os.symlink(ts.name, tmp)
        os.rename(tmp, self.root / "..data")  # the one atomic switch
        if not (self.root / FILE_NAME).is_symlink():
            os.symlink(f"..data/{FILE_NAME}", self.root / FILE_NAME)
        if old:
            for f in (self.root / old).iterdir():
                f.unlink()
            (self.root / old).rmdir()
