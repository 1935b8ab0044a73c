"""Which labels need a CJK font, in which order the installed ones are tried, and the font files matplotlib's
cached list lacks (the report's use of them: tests/test_report.py)."""

from __future__ import annotations

import dataclasses

from loracls.training import fonts


def test_chinese_japanese_and_korean_labels_need_a_cjk_font_and_others_do_not():
    assert fonts.needs_cjk(["正面", "negative"])
    assert fonts.needs_cjk(["ひらがな"]) and fonts.needs_cjk(["한국어"])
    assert not fonts.needs_cjk(["positive", "négatif", "отрицательный", "route_xx_refund"])


def test_installed_cjk_fonts_come_in_the_preferred_order(monkeypatch):
    manager = fonts.font_manager.fontManager
    dejavu = next(f for f in manager.ttflist if f.name == "DejaVu Sans")
    names = ("SimHei", "DejaVu Sans", "Noto Sans CJK SC")
    listed = [dataclasses.replace(dejavu, name=name) for name in names]
    monkeypatch.setattr(manager, "ttflist", listed)
    assert fonts.installed_cjk_fonts() == ["Noto Sans CJK SC", "SimHei"]  # CJK_FONTS' order, not the list's


def test_unreadable_font_files_are_skipped_and_only_new_ones_added(tmp_path, monkeypatch):
    manager = fonts.font_manager.fontManager
    known = manager.ttflist[0].fname
    broken = tmp_path / "broken.ttf"
    broken.write_bytes(b"not a font")
    tried, dumped = [], []

    def addfont(path):
        tried.append(path)
        raise RuntimeError("Can not load face")  # FreeType's error for a file it cannot read

    monkeypatch.setattr(manager, "addfont", addfont)
    monkeypatch.setattr(fonts.font_manager, "findSystemFonts", lambda: [known, str(broken)])
    monkeypatch.setattr(fonts.font_manager, "json_dump", lambda data, path: dumped.append(path))
    assert fonts.add_new_fonts() == 1  # the one file the list lacked, though it could not be read
    assert tried == [str(broken)] and len(dumped) == 1
    monkeypatch.setattr(fonts.font_manager, "findSystemFonts", lambda: [known])
    assert fonts.add_new_fonts() == 0 and len(dumped) == 1  # nothing new: the cache is not rewritten
