"""Tiny local models and data: every test runs offline and in seconds (except those marked slow)."""

from __future__ import annotations

import io
import os
import random
import string
from pathlib import Path

import gguf
import pandas as pd
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4AudioConfig,
    Gemma4Config,
    Gemma4ForCausalLM,
    Gemma4ForConditionalGeneration,
    Gemma4TextConfig,
    Gemma4VisionConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from typer.testing import CliRunner

from loracls.environment.cpu import SLOW_CPU_OVERRIDE

# `--int8` is refused on CPUs without int8 dot-product instructions (too slow there); the tests check its
# numbers on whatever CPU runs them (tests/test_int8.py checks the refusal with this unset)
os.environ[SLOW_CPU_OVERRIDE] = "1"

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2`: each worker, and what it starts, on one thread
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

FIRST = ("test_e2e_gemma.py", "test_distributed.py")
"""The longest files, started first so that `pytest -n 2 --dist loadfile` does not end on one of them."""


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path.name not in FIRST)  # stable: the rest keep their order


SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
CHARACTERS = string.printable.strip() + " \n" + "很好差的书"
WIDTH = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
)


def char_tokenizer(with_pad_and_unk: bool = True) -> PreTrainedTokenizerFast:
    """One token per character; optionally without pad/unk tokens, like several real base models."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + sorted(set(CHARACTERS)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()  # decode("g", "o") -> "go", as real tokenizers round-trip text
    specials = {"eos_token": "<eos>", "bos_token": "<bos>"}
    if with_pad_and_unk:
        specials.update(pad_token="<pad>", unk_token="<unk>")
    return PreTrainedTokenizerFast(tokenizer_object=backend, **specials)


def build_tiny(family: str, folder: Path) -> Path:
    """Save a 2-layer, 32-wide causal LM and its tokenizer, as a user's local model folder would be."""
    torch.manual_seed(0)
    vocab = len(SPECIALS) + len(set(CHARACTERS))
    if family == "gemma3":
        config = Gemma3TextConfig(
            vocab_size=vocab,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            **WIDTH,
        )
        model, tokenizer = Gemma3ForCausalLM(config), char_tokenizer()
    elif family in ("gemma4", "gemma4mm"):
        config = gemma4_text_config(vocab)
        if family == "gemma4":
            model = Gemma4ForCausalLM(config)
        else:
            # the multimodal checkpoint: the language model sits under model.language_model, beside
            # vision and audio towers built from Gemma4ClippableLinear (which PEFT cannot wrap)
            vision = Gemma4VisionConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=16,
                use_clipped_linears=True,
            )
            audio = Gemma4AudioConfig(
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                subsampling_conv_channels=[8, 4],
                output_proj_dims=32,
            )
            model = Gemma4ForConditionalGeneration(
                Gemma4Config(
                    text_config=config.to_dict(), vision_config=vision.to_dict(), audio_config=audio.to_dict()
                )
            )
        tokenizer = char_tokenizer()
    elif family == "llama":
        config = LlamaConfig(vocab_size=vocab, pad_token_id=None, eos_token_id=1, bos_token_id=2, **WIDTH)
        model, tokenizer = LlamaForCausalLM(config), char_tokenizer(with_pad_and_unk=False)
    elif family == "qwen3":
        config = Qwen3Config(vocab_size=vocab, pad_token_id=None, eos_token_id=1, bos_token_id=2, **WIDTH)
        model, tokenizer = Qwen3ForCausalLM(config), char_tokenizer(with_pad_and_unk=False)
    else:
        raise ValueError(family)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def gemma4_text_config(vocab: int) -> Gemma4TextConfig:
    """Gemma 4's text model at test size, with its per-layer input embeddings (PLE) switched on."""
    return Gemma4TextConfig(
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab,
        hidden_size_per_layer_input=8,
        global_head_dim=16,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        **WIDTH,
    )


def write_tiny_gguf(path: Path) -> Path:
    """A GGUF file as llama.cpp writes a Llama model, but holding only its metadata and tokenizer (one token
    per lower-case letter, SentencePiece style, `<unk>` `<s>` `</s>`) and no weights: transformers builds the
    tokenizer from it; a conversion (`model.convert_gguf`) would find nothing to convert."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    tokens = ["<unk>", "<s>", "</s>", "\u2581", *string.ascii_lowercase]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([2, 3, 3] + [1] * (len(tokens) - 3))  # unknown, control, control, normal...
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


FAMILIES = ("gemma3", "gemma4", "gemma4mm", "llama", "qwen3")

LM_SCALE = 15.0
"""How much `lm_models` scales the tiny models' token embeddings (and an untied LM head): at transformers'
N(0, 0.02) a 32-wide model's logits span about +-0.6, so no response can be learned through its frozen LM
head (the loss stays near ln(vocabulary)); at std 0.3 they have a trained model's range."""


@pytest.fixture(scope="session")
def lm_models(tmp_path_factory) -> dict[str, Path]:
    """The tiny models with the logit range of a trained language model, for `objective: lm`."""
    root = tmp_path_factory.mktemp("lm-models")
    models = {}
    for family in FAMILIES:
        folder = build_tiny(family, root / family)
        cls = Gemma4ForConditionalGeneration if family == "gemma4mm" else AutoModelForCausalLM
        model = cls.from_pretrained(folder)
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(LM_SCALE)
            if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
                model.get_output_embeddings().weight.mul_(LM_SCALE)
        model.save_pretrained(folder)
        models[family] = folder
    return models


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {family: build_tiny(family, root / family) for family in FAMILIES}


def toy_reviews(n: int, seed: int = 0) -> pd.DataFrame:
    """A learnable two-class task: the label is decided by one word among filler."""
    rng = random.Random(seed)
    words = {"positive": ["good", "great", "love"], "negative": ["bad", "awful", "hate"]}
    filler = ["the", "book", "was", "and", "it", "very", "plot", "story"]
    rows = []
    for i in range(n):
        label = "positive" if i % 2 == 0 else "negative"
        parts = rng.sample(filler, rng.randint(1, 6)) + [rng.choice(words[label])]
        rng.shuffle(parts)
        # a random suffix keeps texts distinct without the row number's parity giving the label away
        rows.append({"text": " ".join(parts) + f" #{rng.randint(0, 9999)}", "label": label})
    return pd.DataFrame(rows)


@pytest.fixture
def toy_csv(tmp_path) -> Path:
    path = tmp_path / "reviews.csv"
    toy_reviews(120).to_csv(path, index=False)
    return path


FAST = [
    *("--epochs", "2", "--batch-size", "16", "--micro-batch-size", "8", "--eval-every", "4"),
    *("--log-every", "2", "--lr", "5e-3", "--max-length", "64", "--min-steps", "0"),
]
"""Training options that finish a toy run in seconds."""


def invoke(*args):
    """Run the `loracls` CLI in-process."""
    from loracls.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="session")
def trained(tiny_models, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """One finished run per model family through the CLI, shared by the tests: (run folder, output)."""
    root = tmp_path_factory.mktemp("runs")
    data = root / "reviews.csv"
    toy_reviews(120).to_csv(data, index=False)
    runs = {}
    for family, model in tiny_models.items():
        out = root / family
        result = invoke("train", "--model", model, "--data", data, "--out", out, *FAST)
        assert result.exit_code == 0, result.output
        runs[family] = (out, result.output)
    return runs


@pytest.fixture(scope="session")
def quick_run(tiny_models, tmp_path_factory) -> Path:
    """One finished Llama run, trained the quickest way (no prompt search, no baseline), for the tests of
    what reads a run (predict, eval, export) that need just one."""
    root = tmp_path_factory.mktemp("quick")
    data = root / "reviews.csv"
    toy_reviews(120).to_csv(data, index=False)
    args = ("--no-baseline", "--head-init", "zero")
    result = invoke(
        "train", "--model", tiny_models["llama"], "--data", data, "--out", root / "run", *FAST, *args
    )
    assert result.exit_code == 0, result.output
    return root / "run"


@pytest.fixture
def terminal(monkeypatch) -> io.StringIO:
    """What loracls's console (`loracls.console.console`) draws on a 200-column terminal: its live bars
    (each one's last frame stays in the buffer; on a screen it is cleared)."""
    from loracls.console import console

    screen = io.StringIO()
    monkeypatch.setenv("TERM", "xterm")  # rich draws no bars on a dumb terminal
    monkeypatch.setattr(console, "_file", screen)
    monkeypatch.setattr(console, "_force_terminal", True)
    monkeypatch.setattr(console, "is_interactive", True)
    monkeypatch.setattr(console, "_width", 200)
    return screen


@pytest.fixture
def log_file(monkeypatch) -> io.StringIO:
    """What loracls's console writes to a log (not a terminal: no bars), every stage's plain lines due at
    once (`FIRST_LINE_S` and `LOG_EVERY_S` 0)."""
    from loracls import console as module

    log = io.StringIO()
    monkeypatch.setattr(module.console, "_file", log)
    monkeypatch.setattr(module.console, "_force_terminal", False)
    monkeypatch.setattr(module.console, "is_interactive", False)
    monkeypatch.setattr(module.console, "_width", 200)
    monkeypatch.setattr(module, "FIRST_LINE_S", 0.0)
    monkeypatch.setattr(module, "LOG_EVERY_S", 0.0)
    return log
