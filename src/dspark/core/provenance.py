"""Where a result comes from, recorded the same way by every stage that publishes one (evaluate and
schedule ``meta.json``, the benchmark reports): the command, the commit, the machine, the date."""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["checkout_root", "command_line", "git_commit", "machine", "provenance"]

_PROJECT = re.compile(r'^name\s*=\s*"dspark"\s*$', re.MULTILINE)


@functools.cache
def checkout_root() -> Path | None:
    """The source checkout this package runs from (an editable install of the src layout,
    ``<root>/src/dspark``), or None when it runs from an installed wheel."""
    root = Path(__file__).resolve().parents[3]
    project = root / "pyproject.toml"
    if project.is_file() and _PROJECT.search(project.read_text(encoding="utf-8")):
        return root
    return None


def git_commit() -> str | None:
    """``DSPARK_COMMIT`` when set (a copied tree may carry a stale .git), else the checkout's HEAD;
    None outside a git checkout."""
    if os.environ.get("DSPARK_COMMIT"):
        return os.environ["DSPARK_COMMIT"]
    root = checkout_root()
    if root is None:
        return None
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=root
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run, e.g. ``python -m dspark.evaluate drafter_dir=…``."""
    args = sys.argv[1:] if argv is None else list(argv)
    return " ".join(["python", "-m", module, *args])


def machine(device=None) -> dict:
    """Host, platform, torch, and the device the work ran on (with the GPU's name on CUDA)."""
    import torch

    out = {"host": platform.node(), "platform": platform.platform(), "torch": torch.__version__}
    if device is not None:
        device = torch.device(device)
        out["device"] = str(device)
        if device.type == "cuda":
            out["accelerator"] = torch.cuda.get_device_name(device)
    return out


def provenance(module: str, argv: Sequence[str] | None = None, device=None) -> dict:
    return {
        "command": command_line(module, argv),
        "commit": git_commit(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
    }
