"""A frontier folder (python -m dspark.schedule): ``frontier.json`` (points per policy and the cost
table they were priced with), ``cost_table.json`` (measured mode), ``meta.json`` (stamped:
provenance, timings, config), and the Fig. 7 / Fig. 8 plots with their JSON."""

from __future__ import annotations

from pathlib import Path

from .folder import Folder


class FrontierFolder(Folder):
    kind = "frontier"
    FRONTIER = "frontier.json"
    COST_TABLE = "cost_table.json"
    META = DESCRIPTOR = "meta.json"

    @property
    def cost_table_path(self) -> Path:
        return self.file(self.COST_TABLE)

    def write_frontier(self, frontier: dict) -> Path:
        return self.write_json(self.FRONTIER, frontier)

    def read_frontier(self) -> dict:
        return self.read_json(self.FRONTIER)

    def write_meta(self, meta: dict) -> Path:
        return self.write_json(self.META, meta)

    def read_meta(self) -> dict:
        return self.read_json(self.META, {})
