"""The dashboards' screenshots: cropped to the page, never cut off silently."""

import shutil

import numpy as np
import pytest
from PIL import Image

from dspark.core.errors import ConfigError
from dspark.reporting.screenshot import BROWSERS, MARGIN, content_height, screenshot

BROWSER = next((b for b in BROWSERS if shutil.which(b)), None)


def test_content_height_is_the_last_drawn_row():
    page = np.full((100, 50, 3), 255, np.uint8)
    assert content_height(page) == 0  # nothing drawn
    page[40, 7] = (0, 0, 200)
    page[90:, :] = 250  # a faint tint below (anti-aliasing, a background): not drawn
    assert content_height(page) == 41


def test_screenshot_names_a_missing_page_or_browser(tmp_path):
    with pytest.raises(ConfigError, match="no such page; give a dashboard's index.html"):
        screenshot(tmp_path / "index.html", tmp_path / "out.png")
    (tmp_path / "index.html").write_text("<p>x</p>")
    with pytest.raises(ConfigError, match=r"no headless browser found \(no-such-browser\): install chromium"):
        screenshot(tmp_path / "index.html", tmp_path / "out.png", browser="no-such-browser")
    assert not (tmp_path / "out.png").exists()


@pytest.mark.skipif(BROWSER is None, reason="no headless browser on this machine")
def test_screenshot_crops_below_the_page_and_refuses_a_cut_off_one(tmp_path):
    html = tmp_path / "index.html"
    block = '<div style="height:300px;width:200px;background:#000"></div>'
    html.write_text(f'<body style="margin:0">{block}</body>')
    out = screenshot(html, tmp_path / "shot.png", width=400, max_height=1000)
    image = Image.open(out)
    assert image.mode == "P" and image.width == 400  # 256 colours
    assert image.height == 300 + MARGIN
    with pytest.raises(ConfigError, match=r"bottom edge \(200 px\).*--max-height \(e.g. 400\)"):
        screenshot(html, tmp_path / "cut.png", width=400, max_height=200)
    assert not (tmp_path / "cut.png").exists()
