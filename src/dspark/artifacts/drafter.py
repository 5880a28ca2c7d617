"""A drafter folder: ``config.json`` (ours, stamped; or a DeepSpec/engine layout, which
dspark.checkpoints translates), ``model.safetensors``, and what calibration adds:
``calibration.json`` (STS temperatures, applied by every engine that loads the folder) and, from
training, ``calibration_report.json`` (validation metrics) and ``token_counts.safetensors`` (the
training answers' tokens, from which ``decoding.draft_vocab`` picks a draft vocabulary)."""

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
    TOKEN_COUNTS = "token_counts.safetensors"  # [V] int64: the training answers' tokens (draft_vocab)

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

    def read_token_counts(self):
        """How often each token id occurs in the answers the drafter was trained on, or None."""
        path = self.file(self.TOKEN_COUNTS)
        return self.load_token_counts(path) if path.is_file() else None

    def write_token_counts(self, counts) -> Path:
        path = self.file(self.TOKEN_COUNTS)
        atomic_save_safetensors(path, {"counts": counts.detach().long().cpu().contiguous()})
        return path

    @staticmethod
    def load_token_counts(path: str | os.PathLike):
        from safetensors.torch import load_file

        try:
            return load_file(str(path))["counts"]
        except Exception as err:  # a missing file, another safetensors file, a torn write
            raise DrafterCheckpointError(f"{path} holds no token counts ({err})") from None


def load_calibration(path: str | os.PathLike) -> Calibration:
    """STS temperatures from a calibration.json, or from the drafter / evaluation folder holding one."""
    path = Path(path).expanduser()
    return Calibration.load(path / CALIBRATION if path.is_dir() else path)
