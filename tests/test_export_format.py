"""The export folder's own files: what a model folder holds, and how an export says it reads texts."""

from __future__ import annotations

import json

import pytest

from loracls.errors import LoraclsError
from loracls.inference.export_format import EXPORT_INFO, folder_kind, read_export_info, reads_texts, shortened


def test_a_folder_is_a_run_an_export_or_refused_by_name(tmp_path):
    run, export, other = tmp_path / "run", tmp_path / "export", tmp_path / "other"
    for folder in (run, export, other):
        folder.mkdir()
    (run / "status.json").write_text("{}")
    (export / EXPORT_INFO).write_text(json.dumps({"labels": ["a", "b"]}))
    assert folder_kind(run) == "run" and folder_kind(export) == "export"
    assert read_export_info(export) == {"labels": ["a", "b"]}
    with pytest.raises(LoraclsError, match=f"{other} is neither a loracls run folder nor a loracls export"):
        folder_kind(other)


def test_an_export_says_whether_its_tokenizer_adds_the_prompt():
    prompt = {"prefix": "Review: ", "suffix": "\nSentiment:"}
    assert reads_texts({"prompt": None}) == "it reads each text as it is (no prompt)"
    added = reads_texts({"prompt": prompt, "tokenizer_adds_prompt": True})
    assert "give it raw texts" in added and "'Review: ' + text + '\\nSentiment:'" in added
    slow = reads_texts({"prompt": prompt, "tokenizer_adds_prompt": False})
    assert slow.startswith("note:") and "tokenize 'Review: ' + text" in slow


def test_a_long_prompt_is_shown_by_its_end():
    assert shortened("x" * 40) == repr("x" * 40)
    assert shortened("a" * 50 + "Label:", 10) == repr("...aaaaLabel:")
