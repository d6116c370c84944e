"""Generation (megabeta/infer/generate.py): greedy decoding is the argmax of the full forward,
sampling is seeded, and top-k / top-p keep the right tokens.

`megabeta generate` stops at the end-of-document token by default (`--stop-at-eod`), as a
model trained on packed documents needs: after EOS it would start another, unrelated document."""

from __future__ import annotations

from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from torch import Tensor

from megabeta.checkpoint.export import ModelSource
from megabeta.infer import cli, generate, sample_next
from megabeta.infer.generate import stop_at_token
from support.corpus import documents, train_tiny_tokenizer, write_jsonl
from support.model_helpers import tiny_config, tiny_model, tokens


@pytest.mark.parametrize("arch", ["beta12", "standard", "looped"])
def test_greedy_generation_equals_argmax_of_full_forward(arch: str) -> None:
    model = tiny_model(arch=arch, block_size=3)
    prompt = tokens(length=5)
    out = generate(model, prompt, max_new_tokens=7, temperature=0)
    assert out.shape == (2, 12)
    assert torch.equal(out[:, :5], prompt)
    for t in range(5, 12):
        assert torch.equal(out[:, t], model(out[:, :t])[:, -1].argmax(-1))


def test_sampling_is_seeded_and_filters_apply() -> None:
    model = tiny_model(block_size=3)
    prompt = tokens(length=4)
    a = generate(model, prompt, 6, temperature=1.0, top_k=5, seed=7)
    b = generate(model, prompt, 6, temperature=1.0, top_k=5, seed=7)
    c = generate(model, prompt, 6, temperature=1.0, top_k=5, seed=8)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(generate(model, prompt, 6, top_k=1, seed=3),
                       generate(model, prompt, 6, temperature=0))


def test_top_k_and_top_p_keep_the_right_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen_k = {int(sample_next(logits, 1.0, 2, None, gen)) for _ in range(200)}
    seen_p = {int(sample_next(logits, 1.0, None, 0.7, gen)) for _ in range(200)}
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}  # 0.5 < 0.7 needs the second token, 0.8 >= 0.7 stops there
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, 1.0, None, 1.5, gen)


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
