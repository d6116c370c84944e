"""`megabeta generate` stops at the end-of-document token by default (`--stop-at-eod`), as a
model trained on packed documents needs: after EOS it would start another, unrelated document."""

from __future__ import annotations

from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from torch import Tensor

from megabeta.checkpoint.export import ModelSource
from megabeta.infer import cli
from megabeta.infer.generate import generate, stop_at_token
from support.corpus import documents, train_tiny_tokenizer, write_jsonl
from support.model_helpers import tiny_config


class Scripted:
    """A stand-in model whose greedy continuation is `script` (one-hot logits)."""

    training = False

    def __init__(self, script: list[int], vocab: int) -> None:
        self.script, self.vocab = script, vocab
        self.config = tiny_config(vocab_size=vocab)

    def _logits(self, batch: int, index: int) -> Tensor:
        logits = torch.zeros(batch, self.vocab)
        logits[:, self.script[index]] = 1.0
        return logits

    def prefill(self, prompt: Tensor, capacity: int) -> tuple[Tensor, list[int]]:
        return self._logits(prompt.shape[0], 0)[:, None], [0]

    def step(self, token: Tensor, cache: list[int]) -> Tensor:
        cache[0] += 1
        return self._logits(token.shape[0], cache[0])

    def eval(self) -> None:
        pass

    def train(self, mode: bool) -> None:
        pass


def test_generation_stops_after_the_end_of_document_token():
    eod = 2
    model = Scripted([7, 8, eod, 9, 10, 11], vocab=16)
    prompt = torch.tensor([[5, 6]])
    stopped = generate(model, prompt, 6, temperature=0, stop=stop_at_token(eod))
    assert stopped.tolist() == [[5, 6, 7, 8, eod]]
    assert generate(model, prompt, 6, temperature=0).tolist() == [[5, 6, 7, 8, eod, 9, 10, 11]]


def test_a_batch_stops_when_every_row_has_ended():
    stop = stop_at_token(2)
    assert not stop(torch.tensor([[7, 2], [7, 8]]))
    assert stop(torch.tensor([[7, 2, 9], [7, 8, 2]]))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("eod")
    return train_tiny_tokenizer(root, [write_jsonl(root / "c.jsonl", documents(600, seed=3))],
                                vocab_size=300)


@pytest.mark.parametrize("flag, stops", [([], True), (["--stop-at-eod"], True),
                                         (["--no-stop-at-eod"], False)])
def test_the_cli_prints_the_text_before_the_end_of_document(tokenizer, monkeypatch, capsys,
                                                            flag, stops):
    processor = spm.SentencePieceProcessor(model_file=str(tokenizer))
    before, after = processor.encode("alpha beta"), processor.encode(" gamma delta")
    model = Scripted([*before, processor.eos_id(), *after], vocab=processor.vocab_size())
    source = ModelSource(Path("m.safetensors"), model.config, tokenizer={"path": str(tokenizer)})
    monkeypatch.setattr(cli, "read_source", lambda path: source)
    monkeypatch.setattr(cli, "load_model", lambda path: model)
    new_tokens = len(before) + 1 + len(after)
    assert cli.generate_main(["--checkpoint=m.safetensors", "--prompt=x", "--temperature=0",
                              f"--max-new-tokens={new_tokens}", *flag]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    text = processor.decode(before)
    assert printed == "x" + (text if stops else processor.decode(
        [*before, processor.eos_id(), *after]))
