"""Progress bars on the long loops (decoding, replay, measuring): one tqdm, or none when off."""

from __future__ import annotations


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "it"):
    """A tqdm bar, or None when ``enabled`` is false (callers update it only when it exists)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)
