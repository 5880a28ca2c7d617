"""A dashboard's screenshot, the whole page and nothing below it.

    python -m dspark.reporting.screenshot docs/results/dashboard-block/index.html \\
        docs/results/dashboard-block.png [--width 1600] [--max-height 20000] [--browser chromium]

A headless browser draws the page into a window ``--max-height`` pixels tall (it cannot size the
window to the page); the picture is cropped below the page's last drawn row and stored with 256
colours (a quarter of the bytes, the figures alike). A page that reaches the window's bottom edge
would be cut off silently, so that is an error naming the height to ask for.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ..core.errors import ConfigError

__all__ = ["content_height", "main", "screenshot"]

MARGIN = 30  # white rows kept below the page's last drawn row
BROWSERS = ("chromium", "chromium-browser", "google-chrome")  # tried in this order
INK = 30  # a pixel counts as drawn where its channels, summed, fall short of white's by more than this


def content_height(pixels: np.ndarray) -> int:
    """Rows down to the last one with any drawn pixel (``pixels`` [H, W, 3], uint8 on white)."""
    drawn = (255 - pixels.astype(np.int32)).sum(axis=-1) > INK
    rows = np.flatnonzero(drawn.any(axis=1))
    return int(rows[-1]) + 1 if rows.size else 0


def screenshot(
    html: str | os.PathLike, out: str | os.PathLike, width=1600, max_height=20000, browser=None
) -> Path:
    """``html`` drawn by ``browser`` (the first of ``BROWSERS`` found) ``width`` pixels wide, cropped
    below the page, written to ``out`` with 256 colours; ``max_height``: the window's height."""
    from PIL import Image

    html, out = Path(html), Path(out)
    if not html.is_file():
        raise ConfigError(f"{html}: no such page; give a dashboard's index.html (python -m dspark.report …)")
    browser = browser or next((b for b in BROWSERS if shutil.which(b)), None)
    if browser is None or shutil.which(browser) is None:
        raise ConfigError(
            f"no headless browser found ({browser or ', '.join(BROWSERS)}): "
            "install chromium (apt install chromium) or name one with --browser"
        )
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "page.png"
        subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             f"--window-size={width},{max_height}", f"--screenshot={raw}", html.resolve().as_uri()],
            check=True, capture_output=True, timeout=300,
        )  # fmt: skip
        image = Image.open(raw).convert("RGB")
        height = content_height(np.asarray(image))
        if height >= image.height - 1:
            raise ConfigError(
                f"{html} is drawn down to the window's bottom edge ({image.height} px): the page is longer; "
                f"ask for more with --max-height (e.g. {2 * max_height})"
            )
        cropped = image.crop((0, 0, image.width, min(image.height, height + MARGIN)))
        out.parent.mkdir(parents=True, exist_ok=True)
        part = out.with_name(out.name + ".part.png")
        cropped.quantize(256).save(part, optimize=True)
        os.replace(part, out)  # a screenshot half written is never left as the published one
    return out


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(
        prog="python -m dspark.reporting.screenshot", description=__doc__.split("\n")[0]
    )
    parser.add_argument("html")
    parser.add_argument("out")
    parser.add_argument("--width", type=int, default=1600)
    parser.add_argument("--max-height", type=int, default=20000)
    parser.add_argument("--browser")
    args = parser.parse_args(argv)
    path = screenshot(args.html, args.out, args.width, args.max_height, args.browser)
    print(path)
    return path


if __name__ == "__main__":
    from ..cli import user_errors

    with user_errors():
        main()
