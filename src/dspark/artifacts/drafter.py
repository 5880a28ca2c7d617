"""A drafter folder: ``config.json`` (ours, stamped; or a DeepSpec/engine layout, which
dspark.checkpoints translates), ``model.safetensors``, and what calibration adds:
``calibration.json`` (STS temperatures, applied by every engine that loads the folder) and, from
training, ``calibration_report.json`` (validation metrics)."""

from __future__ import annotations

import os
from pathlib import Path

from ..calibration.sts import Calibration
from ..core.errors import DrafterCheckpointError
from ..core.io import atomic_save_safetensors
from .folder import Folder

CALIBRATION = "calibration.json"


class DrafterFolder(Folder):
    kind = "drafter"
    CONFIG = DESCRIPTOR = "config.json"
    WEIGHTS = "model.safetensors"
    CALIBRATION = CALIBRATION
    CALIBRATION_REPORT = "calibration_report.json"

    @property
    def config_path(self) -> Path:
        return self.file(self.CONFIG)

    @property
    def weights_path(self) -> Path:
        return self.file(self.WEIGHTS)

    def exists(self) -> bool:
        return self.config_path.is_file()

    def read_config(self) -> dict:
        if not self.exists():
            raise DrafterCheckpointError(f"{self.path} is not a drafter checkpoint (no {self.CONFIG} there)")
        return self.read_json(self.CONFIG)

    def write(self, config: dict, weights: dict) -> None:
        """Weights first, then the config: a folder with a config is complete."""
        atomic_save_safetensors(self.weights_path, weights)
        self.write_json(self.CONFIG, config)

    def read_calibration(self) -> Calibration | None:
        path = self.file(self.CALIBRATION)
        return Calibration.load(path) if path.is_file() else None

    def write_calibration(self, calibration: Calibration) -> Path:
        return calibration.save(self.file(self.CALIBRATION))

    def read_calibration_report(self) -> dict | None:
        return self.read_json(self.CALIBRATION_REPORT, None)

    def write_calibration_report(self, report: dict) -> Path:
        return self.write_json(self.CALIBRATION_REPORT, report)


def load_calibration(path: str | os.PathLike) -> Calibration:
    """STS temperatures from a calibration.json, or from the drafter / evaluation folder holding one."""
    path = Path(path).expanduser()
    return Calibration.load(path / CALIBRATION if path.is_dir() else path)
