"""The objective seam: every name `TrainConfig.objective` accepts has a class in `OBJECTIVES`, and what
differs between a classification head and instruction tuning (how a text is read, whether a prompt is
needed, what is decided before it, how an export is loaded and named) is answered by that class."""

import pytest
import torch

from loracls.config import TrainConfig
from loracls.errors import LoraclsError
from loracls.model import load_tokenizer
from loracls.objective import OBJECTIVES, ClassificationHead, LanguageModel, input_prompter, objective_kind

LABELS = ["negative", "positive"]
PINNED = {"prompt": "en-label", "verbalizers": "negative=bad,positive=good"}


def test_every_objective_the_config_accepts_has_a_class_and_no_other_does():
    for name in OBJECTIVES:
        assert objective_kind(name).name == name
        assert TrainConfig(objective=name).objective == name
    with pytest.raises(LoraclsError, match="objective"):
        TrainConfig(objective="seq2seq")


@pytest.mark.parametrize(
    ("head_init", "prompted"), [("zero", False), ("normal", False), ("auto", None), ("verbalizer", True)]
)
def test_a_head_reads_the_prompt_only_when_it_starts_from_it(tiny_models, head_init, prompted):
    """`auto` needs the prompt to decide (and reads raw text until it has decided); `verbalizer` reads every
    text inside it, with the start its labels' words share; `zero`/`normal` read the text as it is."""
    tokenizer = load_tokenizer(str(tiny_models["llama"]))
    cfg = TrainConfig(head_init=head_init, **PINNED)
    assert ClassificationHead.needs_prompt(cfg) == (head_init in ("auto", "verbalizer"))
    prompter = input_prompter(tokenizer, cfg, LABELS)
    assert (prompter is not None) == bool(prompted)
    if prompter is not None:
        assert prompter.answer_start == [] or all(isinstance(i, int) for i in prompter.answer_start)
        assert not prompter.chat
    assert ClassificationHead.label_tokens(prompter) is None
    assert ClassificationHead.trains_head and not ClassificationHead.generates


def test_a_multi_label_head_starts_at_zero_and_an_lm_pins_the_chat_template(tiny_models):
    tokenizer = load_tokenizer(str(tiny_models["llama"]))
    multi = TrainConfig(multi_label=True)
    ClassificationHead.pin_defaults(multi, tokenizer)
    assert multi.head_init == "zero"
    lm = TrainConfig(objective="lm", **PINNED)
    LanguageModel.pin_defaults(lm, tokenizer)
    assert lm.chat_template is (tokenizer.chat_template is not None)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat = TrainConfig(objective="lm", **PINNED)
    LanguageModel.pin_defaults(chat, tokenizer)
    assert chat.chat_template is True
    assert input_prompter(tokenizer, chat, LABELS).chat


def test_an_lm_reads_every_text_inside_the_prompt_and_records_its_label_words(tiny_models):
    tokenizer = load_tokenizer(str(tiny_models["llama"]))
    cfg = TrainConfig(objective="lm", head_init="zero", chat_template=False, **PINNED)
    assert LanguageModel.needs_prompt(cfg) and not LanguageModel.trains_head and LanguageModel.generates
    prompter = input_prompter(tokenizer, cfg, LABELS)
    words = LanguageModel.label_tokens(prompter)
    assert words == {"negative": tokenizer(" bad", add_special_tokens=False)["input_ids"]} | {
        "positive": tokenizer(" good", add_special_tokens=False)["input_ids"]
    }
    objective = LanguageModel.for_inference(torch.nn.Linear(1, 1), prompter, LABELS)
    assert objective.tokens == [words["negative"], words["positive"]]


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_a_prompt_still_auto_is_refused_where_the_run_reads_through_it(objective, tiny_models):
    tokenizer = load_tokenizer(str(tiny_models["llama"]))
    cfg = TrainConfig(objective=objective, head_init="verbalizer" if objective == "head" else "zero")
    with pytest.raises(LoraclsError, match="prompt was never chosen"):
        input_prompter(tokenizer, cfg, LABELS)
