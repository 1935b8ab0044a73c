from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from loracls.config import TrainConfig, field_docs, parse_overrides
from loracls.errors import LoraclsError
from loracls.lora import FEW_CLASSES, resolve_capacity
from loracls.training.runs import RunFolder


def test_every_field_has_a_docstring():
    docs = field_docs()
    assert [f.name for f in fields(TrainConfig)] == list(docs)
    assert all(len(text) > 5 for text in docs.values())


def test_defaults_follow_the_recipe():
    """The write-up's LoRA recipe; lr, min_steps and head_init as chosen on validation figures
    (benchmarks/README.md, learning curve)."""
    cfg = TrainConfig()
    assert (cfg.lr, cfg.min_steps, cfg.head_init, cfg.prompt) == (1e-3, 60, "auto", "auto")
    assert (cfg.batch_size, cfg.micro_batch_size) == (32, None)
    assert cfg.target_modules == "auto" and cfg.max_length == 256 and cfg.precision == "auto"


@pytest.mark.parametrize(
    ("given", "classes", "settled"),
    [
        ({}, 2, ("attn-qv", 8, 16)),  # the write-up's recipe for sentiment
        ({}, FEW_CLASSES, ("attn-qv", 8, 16)),
        ({}, FEW_CLASSES + 1, ("all-linear", 16, 32)),  # many classes: measured to need it
        ({"lora_r": 4}, 77, ("all-linear", 4, 8)),  # a rank the user set stays
        ({"target_modules": "attn"}, 77, ("attn", 8, 16)),  # so do targets; the rank follows them, not auto
        ({"lora_alpha": 8}, 2, ("attn-qv", 8, 8)),
    ],
)
def test_lora_capacity_follows_the_number_of_classes(given, classes, settled):
    cfg = TrainConfig(**given)
    line = resolve_capacity(cfg, classes)
    assert (cfg.target_modules, cfg.lora_r, cfg.lora_alpha) == settled
    assert (line is None) == ("target_modules" in given)
    if line:
        assert f"{classes} classes" in line and settled[0] in line


def test_retired_grad_accum_says_what_replaced_it():
    with pytest.raises(LoraclsError, match="batch_size: B\\*A"):
        TrainConfig.load(None, {"batch_size": 16, "grad_accum": 2})


def test_a_run_written_before_the_batch_change_reads_as_the_same_run(tmp_path):
    old = TrainConfig().to_dict() | {"batch_size": 16, "grad_accum": 2, "micro_batch_size": None}
    del old["micro_batch_size"], old["balance_labels"], old["min_steps"]  # that version had no such keys
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    cfg = RunFolder(tmp_path).read_config()
    assert (cfg.batch_size, cfg.micro_batch_size) == (32, 16)
    assert cfg.balance_labels is False  # its batches were sorted by length alone: a resume keeps them so
    assert TrainConfig().balance_labels is True
    assert cfg.min_steps == 0 and TrainConfig().min_steps == 60  # it trained `epochs` alone
    with pytest.raises(LoraclsError, match="grad_accum"):  # as a user's config file: refused, explained
        TrainConfig.load(tmp_path / "config.yaml")


def test_micro_batch_must_divide_the_batch():
    with pytest.raises(LoraclsError, match="micro_batch_size = 5"):
        TrainConfig(batch_size=16, micro_batch_size=5)


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lr: 1e-4\nlora_r: 16\nepochs: 3\n")
    cfg = TrainConfig.load(path, parse_overrides(["lora_r=32", "val=null", "max-length=64"]))
    assert cfg.lr == 1e-4 and isinstance(cfg.lr, float)  # PyYAML reads "1e-4" as a string
    assert cfg.lora_r == 32 and cfg.epochs == 3.0 and cfg.val is None and cfg.max_length == 64


def test_unknown_key_suggests_the_closest(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("lora_rank: 16\n")
    with pytest.raises(LoraclsError, match="Did you mean 'lora_r'"):
        TrainConfig.load(path)


@pytest.mark.parametrize(
    "key,value",
    [
        ("lr", -1),
        ("lora_r", 0),
        ("lora_dropout", 1.0),
        ("val_fraction", 0),
        ("precision", "fp8"),
        ("metric", "loss"),
    ],
)
def test_out_of_range_values_are_named(key, value):
    with pytest.raises(LoraclsError, match=f"{key} = "):
        TrainConfig.load(None, {key: value})


def test_wrong_types_and_bad_yaml(tmp_path):
    with pytest.raises(LoraclsError, match="'lora_r' expects int"):
        TrainConfig.load(None, {"lora_r": "eight"})
    with pytest.raises(LoraclsError, match="expects int"):
        TrainConfig.load(None, {"batch_size": 2.5})
    path = tmp_path / "bad.yaml"
    path.write_text("lr: [1\n")
    with pytest.raises(LoraclsError, match="not valid YAML"):
        TrainConfig.load(path)
    with pytest.raises(LoraclsError, match="key=value"):
        parse_overrides(["lora_r"])


CONFIGS = Path(__file__).parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    """The YAML files the README points to: a training config loads as a TrainConfig, a sweep expands into
    points whose configs all validate (`load_sweep` builds each one)."""
    from loracls.training.sweep import load_sweep

    if path.name.startswith("sweep-"):
        out, points = load_sweep(path)
        assert len(points) >= 2 and all(point.name for point in points)
    else:
        cfg = TrainConfig.load(path)
        assert cfg.to_dict() != TrainConfig().to_dict()  # it sets something


@pytest.mark.parametrize("path", sorted((CONFIGS / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_every_accelerate_config_is_one_accelerate_reads(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.distributed_type in ("MULTI_GPU", "FSDP", "MULTI_CPU")
    assert config.num_processes >= 1


def test_train_help_shows_types_defaults_and_groups():
    """`loracls train --help` listed 60 options in one block, every one typed <str>, no default shown."""
    from loracls.cli_options import GROUPS
    from tests.conftest import invoke

    result = invoke("train", "--help")
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for group in GROUPS:
        assert group in text
    assert "<float>" in text and "<int>" in text and "[default: 0.001]" in text
    assert "[default: auto]" in text and "[default: no-multi-label]" in text
    unset = "--val <str> Validation file (any format `data` reads); when unset, a stratified "
    unset += "`val_fraction` of `data` is held out."
    assert f"{unset} --test" in text  # no default shown for an unset key: its text says what unset does
    assert sorted(k for keys in GROUPS.values() for k in keys) == sorted(f.name for f in fields(TrainConfig))


def test_a_run_written_before_label_type_reads_its_labels_as_strings(tmp_path):
    old = TrainConfig().to_dict()
    del old["label_type"]  # runs wrote string labels before the key existed
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert RunFolder(tmp_path).read_config().label_type == "str"
    assert TrainConfig().label_type == "auto"
