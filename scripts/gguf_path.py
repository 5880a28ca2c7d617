"""Print the local GGUF file of an offline target, for staging it on the GPU machine:

    python scripts/gguf_path.py gemma3_270m        # assembles a chunked package into the cache once
    python ../shared/tools/device_stage.py "$(python scripts/gguf_path.py gemma3_270m)" --wheels ...

The target's own resolution (conf/target/<name>.yaml: its package, or its chunk packages joined and
sha256-checked), so what is staged is what the offline default path loads."""

from __future__ import annotations

import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from dspark.core.errors import TargetError
from dspark.target import default_cache_dir, resolve_source


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/gguf_path.py TARGET  (a conf/target name: gemma3_270m)", file=sys.stderr)
        return 2
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(config_name="train", overrides=[f"target={argv[0]}"]).target
    cache = Path(cfg.get("cache_dir") or default_cache_dir()).expanduser()
    try:
        kind, folder, name = resolve_source(cfg, cache)
    except TargetError as err:
        print(f"target {argv[0]}: {err}", file=sys.stderr)
        return 1
    if kind != "gguf":
        print(f"target {argv[0]} resolves to {kind} {folder}, not a GGUF file", file=sys.stderr)
        return 1
    print(Path(folder) / name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
