"""A training run folder (python -m dspark.train): ``config.yaml`` (the resolved config),
``summary.json`` (stamped: steps, time, throughput, final metrics), ``drafter/`` (a DrafterFolder
kept in step with the checkpoints), ``checkpoints/last.ckpt``, ``logs/`` (CSV) or ``tb/``, and the
one-run dashboard in ``report/``."""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..core.errors import DataError
from ..core.io import atomic_write_text
from .drafter import DrafterFolder
from .folder import Folder


class RunFolder(Folder):
    kind = "run"
    CONFIG = "config.yaml"
    SUMMARY = DESCRIPTOR = "summary.json"

    @property
    def drafter(self) -> DrafterFolder:
        return DrafterFolder(self.path / "drafter")

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def last_checkpoint(self) -> Path:
        return self.checkpoints / "last.ckpt"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tb"

    @property
    def report(self) -> Path:
        return self.path / "report"

    @property
    def profile(self) -> Path:
        """The training step's profile window (bench.step_profile: step_profile.json / .md, the trace)."""
        return self.path / "profile"

    def is_run(self) -> bool:
        """A run's config plus anything a run leaves (a summary, logs, an exported drafter)."""
        traces = (self.file(self.SUMMARY), self.logs, self.drafter.config_path, self.tensorboard)
        return self.file(self.CONFIG).is_file() and any(p.exists() for p in traces)

    def write_config(self, cfg: DictConfig) -> Path:
        return atomic_write_text(self.file(self.CONFIG), OmegaConf.to_yaml(cfg, resolve=True))

    def read_config(self) -> dict:
        """The run's config (DataError when config.yaml is not a readable YAML mapping)."""
        path = self.file(self.CONFIG)
        try:
            config = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        except (yaml.YAMLError, UnicodeDecodeError, OmegaConfBaseException) as err:
            raise DataError(f"{path} is not readable YAML ({' '.join(str(err).split())[:120]})") from None
        if not isinstance(config, dict):
            raise DataError(f"{path} is not a YAML mapping of config keys")
        return config

    def write_summary(self, summary: dict) -> Path:
        return self.write_json(self.SUMMARY, summary)

    def read_summary(self) -> dict:
        """The run's summary ({} while it is still training)."""
        return self.read_json(self.SUMMARY, {})
