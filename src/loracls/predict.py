"""Load a finished run (base model + adapter + head, merged) and classify texts with it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loracls.data import tokenize
from loracls.evaluate import predict_probs
from loracls.model import load_classifier, load_tokenizer, resolve_model
from loracls.runs import RunFolder


@dataclass
class Classifier:
    """A fine-tuned classifier ready for inference: LoRA merged into the base weights."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    labels: list[str]
    max_length: int
    batch_size: int = 32

    @classmethod
    def from_run(cls, run_dir: str) -> Classifier:
        run = RunFolder(run_dir)
        run.check_finished()
        cfg = run.read_config()
        labels = run.read_labels()
        tokenizer = load_tokenizer(str(run.best))
        base = load_classifier(resolve_model(cfg.model), labels, cfg.trust_remote_code)
        base.config.pad_token_id = tokenizer.pad_token_id
        model = PeftModel.from_pretrained(base, str(run.best)).merge_and_unload()
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return cls(model.to(device).eval(), tokenizer, labels, cfg.max_length, cfg.batch_size * 2)

    def predict_probs(self, texts: list[str]) -> np.ndarray:
        table = pd.DataFrame({"text": texts, "label": self.labels[0]})
        dataset = tokenize(table, self.tokenizer, self.max_length, {self.labels[0]: 0})
        return predict_probs(self.model, dataset, self.tokenizer, self.batch_size)

    def predict(self, texts: list[str]) -> list[dict]:
        """One record per text: the predicted label and every label's probability."""
        return [
            {
                "text": text,
                "label": self.labels[int(p.argmax())],
                "probabilities": {name: round(float(x), 6) for name, x in zip(self.labels, p, strict=True)},
            }
            for text, p in zip(texts, self.predict_probs(texts), strict=True)
        ]
