"""The fonts the report's plots draw label names with: a CJK font behind matplotlib's default (which has no
Chinese, Japanese or Korean glyphs) when a label needs one, found even when it was installed after
matplotlib cached its font list."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import font_manager  # noqa: E402

CJK_FONTS = (
    "Noto Sans CJK SC",
    "Noto Sans CJK JP",
    "Noto Sans SC",
    "Source Han Sans SC",
    "WenQuanYi Zen Hei",
    "WenQuanYi Micro Hei",
    "Droid Sans Fallback",
    "AR PL UMing CN",
    "Microsoft YaHei",
    "SimHei",
    "PingFang SC",
    "Hiragino Sans GB",
)
"""Fonts with Chinese (and mostly Japanese/Korean) glyphs, tried in this order after matplotlib's default,
which has none: without one, Chinese label names are drawn as empty boxes."""


def needs_cjk(labels: list[str]) -> bool:
    return any("\u2e80" <= c <= "\u9fff" or "\uac00" <= c <= "\ud7af" for label in labels for c in label)


def use_cjk_font(labels: list[str]) -> str | None:
    """Put an installed CJK font behind the default one when a label needs it; returns a note to show when
    none is installed (None when all is well). Before concluding there is none, the font files on disk that
    matplotlib's font list lacks are added to it (`add_new_fonts`)."""
    if not needs_cjk(labels):
        return None
    found = installed_cjk_fonts()
    if not found and add_new_fonts():
        found = installed_cjk_fonts()
    if not found:
        return (
            "No font with Chinese/Japanese/Korean glyphs is installed, so label names in the plots show as "
            "boxes; install one (Debian/Ubuntu: apt-get install fonts-noto-cjk) and run `loracls report RUN`."
        )
    if plt.rcParams["font.sans-serif"][0] != found[0]:
        plt.rcParams["font.sans-serif"] = [found[0], *plt.rcParams["font.sans-serif"]]
    plt.rcParams["font.family"] = "sans-serif"
    return None


def installed_cjk_fonts() -> list[str]:
    installed = {f.name for f in font_manager.fontManager.ttflist}
    return [name for name in CJK_FONTS if name in installed]


def add_new_fonts() -> int:
    """Add to matplotlib's font list the font files on disk it lacks, and write the list back to its cache;
    returns how many were added.

    matplotlib reads the list from a cache made the first time it ran and never looks again: a font
    installed since (`apt-get install fonts-noto-cjk`, as the note advises) stayed unknown, and the labels
    stayed boxes. The list is updated in place, since the Agg backend holds that very object."""
    manager = font_manager.fontManager
    known = {f.fname for f in manager.ttflist}
    new = [path for path in font_manager.findSystemFonts() if path not in known]
    for path in new:
        try:
            manager.addfont(path)
        except Exception:  # noqa: BLE001 - a file FreeType cannot read is skipped, as matplotlib's own scan does
            continue
    if new:
        cache = Path(matplotlib.get_cachedir(), f"fontlist-v{font_manager.FontManager.__version__}.json")
        font_manager.json_dump(manager, cache)
    return len(new)
