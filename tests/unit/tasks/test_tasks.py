"""Issue 16, item 2: `megabeta tasks make | eval`.

The generators are deterministic per seed and right: an independent solver here (parsing the
text back and simulating it, written apart from the generators) checks every answer of a few
hundred documents of every task and variant. The scorer gives a perfect oracle 100 % and a
constant predictor its chance level; the CLI writes files atomically and evaluates a tiny real
model end to end.
"""

from __future__ import annotations

import json
import math
import re
from itertools import permutations
from pathlib import Path

import numpy as np
import pytest
import torch
from support.corpus import train_tiny_tokenizer
from safetensors.torch import save_file

from data_tools.encode import encode_segments
from data_tools.tokenizer import load_tokenizer
from megabeta.checkpoint.export import EXPORT_FORMAT, load_model
from megabeta.cli import main
from megabeta.data import file_sha256
from megabeta.model import ModelConfig, build_model
from megabeta.tasks.chains import Chains
from megabeta.tasks.document import TaskFileError, read_task_file
from megabeta.tasks.evaluate import encode_documents, evaluate_tasks
from megabeta.tasks.make import generate_documents
from megabeta.tasks.parity import Parity
from megabeta.tasks.permutations import Permutations
from megabeta.tasks.retrieval import Retrieval
from megabeta.tasks.scoring import EncodedDocument, answer_spans, score_documents

VARIANTS = {
    "chains-n8": ["--task=chains", "--hops=8"],
    "chains-n32": ["--task=chains", "--hops=32"],
    "chains-n3-k5-v4": ["--task=chains", "--hops=3", "--chains=5", "--values=4"],
    "S5": ["--task=permutations", "--group=S5"],
    "A5": ["--task=permutations", "--group=A5", "--length=12"],
    "parity": ["--task=parity"],
    "parity-L5": ["--task=parity", "--length=5"],
    "retrieval": ["--task=retrieval"],
    "retrieval-p40-q6-v5": ["--task=retrieval", "--pairs=40", "--queries=6", "--values=5"],
}
SOLVED = 300
"""Documents of each variant whose every answer the solvers check."""


def make(tmp: Path, name: str, *extra: str, count: int = SOLVED, seed: int = 1) -> Path:
    out = tmp / f"{name}-{count}-{seed}.jsonl"
    assert main(["tasks", "make", *VARIANTS[name], f"--count={count}", f"--seed={seed}",
                 f"--output={out}", *extra]) == 0
    return out


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("tasks")
    return {name: make(tmp, name) for name in VARIANTS}


# ---- independent solvers ------------------------------------------------------------------------
def solve_chains(prompt_lines: list[str]) -> tuple[list[str], dict]:
    """Run the program line by line; the value of each query, and what the program was like."""
    value, depth, copied = {}, {}, set()
    answers, query_depths = [], []
    for line in prompt_lines:
        if match := re.fullmatch(r"([a-z]{2})=(\d|[a-z]{2})", line):
            name, source = match.groups()
            assert name not in value, f"{name} assigned twice"
            if source.isdigit():
                value[name], depth[name] = source, 0
            else:
                assert source in value, f"{source} copied before it is assigned"
                value[name], depth[name] = value[source], depth[source] + 1
                copied.add(source)
        else:
            name = re.fullmatch(r"\?([a-z]{2})=", line).group(1)
            answers.append(value[name])
            query_depths.append(depth[name])
    ends = set(value) - copied
    constants = sum(d == 0 for d in depth.values())
    return answers, {"depths": query_depths, "ends": ends, "constants": constants,
                     "values": {int(v) for v in value.values()}}


def matrix(one_line: str) -> np.ndarray:
    """The permutation matrix of a one-line notation: column x holds e_{w(x)}."""
    m = np.zeros((5, 5), dtype=np.int64)
    for x, image in enumerate(one_line):
        m[int(image) - 1, x] = 1
    return m


def from_matrix(m: np.ndarray) -> str:
    return "".join(str(int(np.argmax(m[:, x])) + 1) for x in range(5))


def solve_permutations(prompt_lines: list[str]) -> tuple[list[str], list[int]]:
    """Prefix products as products of permutation matrices (g_i applied after p_(i-1)); and the
    sign (determinant) of each element read."""
    product = np.eye(5, dtype=np.int64)
    answers, signs = [], []
    for line in prompt_lines:
        element = re.fullmatch(r"([1-5]{5})>", line).group(1)
        assert sorted(element) == list("12345"), element
        product = matrix(element) @ product
        answers.append(from_matrix(product))
        signs.append(round(np.linalg.det(matrix(element))))
    return answers, signs


def solve_parity(prompt_lines: list[str]) -> list[str]:
    (line,) = prompt_lines
    bits = re.fullmatch(r"([01]+)=", line).group(1)
    return [str(bits.count("1") % 2)]


def prompts(record: dict) -> tuple[list[str], list[str]]:
    """The document's lines with their answers cut out, and the answers (the scored segments),
    after checking that the segments, `text` and `answers` agree."""
    segments = record["segments"]
    assert "".join(s["text"] for s in segments) == record["text"]
    scored = [s["text"] for s in segments if s["loss"]]
    assert scored == record["answers"] and scored
    for before, after in zip(segments, segments[1:]):
        assert not (before["loss"] and after["loss"]), "two answers in a row"
    assert not segments[0]["loss"] and not segments[-1]["loss"]
    text = "".join("" if s["loss"] else s["text"] for s in segments)
    return [line for line in text.split("\n") if line], scored


@pytest.mark.parametrize("name", ["chains-n8", "chains-n32", "chains-n3-k5-v4"])
def test_chains_answers_match_the_solver(files, name):
    options = {"chains-n8": Chains(hops=8), "chains-n32": Chains(hops=32),
               "chains-n3-k5-v4": Chains(hops=3, chains=5, values=4)}[name]
    seen_values = set()
    for record in records(files[name]):
        assert record["task"] == options.name and record["chance"] == 1 / options.values
        lines, scored = prompts(record)
        answers, program = solve_chains(lines)
        assert answers == scored
        assert program["depths"] == [options.hops] * options.chains  # every query n hops away
        assert len(program["ends"]) == options.chains == program["constants"]
        assert set(re.findall(r"\?([a-z]{2})=", record["text"])) == program["ends"]
        seen_values |= program["values"]
    assert seen_values == set(range(options.values))


@pytest.mark.parametrize("name", ["S5", "A5"])
def test_permutation_answers_match_the_solver(files, name):
    length = 12 if name == "A5" else Permutations().length
    signs = set()
    for record in records(files[name]):
        assert record["task"] == f"permutations-{name}-L{length}"
        lines, scored = prompts(record)
        answers, element_signs = solve_permutations(lines)
        assert answers == scored and len(answers) == length
        signs |= set(element_signs)
    assert signs == ({1} if name == "A5" else {-1, 1})


@pytest.mark.parametrize("name", ["parity", "parity-L5"])
def test_parity_answers_match_the_solver(files, name):
    length = 5 if name == "parity-L5" else Parity().length
    for record in records(files[name]):
        assert record["task"] == f"parity-L{length}" and record["chance"] == 0.5
        lines, scored = prompts(record)
        assert solve_parity(lines) == scored and len(lines[0]) == length + 1


@pytest.mark.parametrize("name", ["retrieval", "retrieval-p40-q6-v5"])
def test_retrieval_answers_match_the_solver(files, name):
    options = Retrieval() if name == "retrieval" else Retrieval(pairs=40, queries=6, values=5)
    seen_values = set()
    for record in records(files[name]):
        assert record["task"] == options.name and record["chance"] == 1 / options.values
        lines, scored = prompts(record)
        answers, program = solve_chains(lines)
        assert answers == scored and len(answers) == options.queries
        assert program["depths"] == [0] * options.queries  # read, not followed
        assert program["constants"] == options.pairs
        queried = re.findall(r"\?([a-z]{2})=", record["text"])
        assert len(set(queried)) == options.queries
        seen_values |= program["values"]
    assert seen_values == set(range(options.values))


# ---- determinism and the file ------------------------------------------------------------------
@pytest.mark.parametrize("name", VARIANTS)
def test_same_seed_same_bytes_other_seed_other_bytes(files, tmp_path, name):
    again = make(tmp_path, name)
    assert again.read_bytes() == files[name].read_bytes()
    assert make(tmp_path, name, seed=2).read_bytes() != files[name].read_bytes()
    # One generator drawn in order: a shorter file is the start of a longer one.
    shorter = make(tmp_path, name, count=40).read_bytes()
    assert files[name].read_bytes().startswith(shorter)


def test_make_refuses_to_overwrite_and_leaves_no_temporary(tmp_path, capsys):
    out = make(tmp_path, "parity", count=5)
    before = out.read_bytes()
    status = main(["tasks", "make", "--task=parity", "--count=9", "--seed=3", f"--output={out}"])
    assert status == 2 and "--overwrite" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert main(["tasks", "make", "--task=parity", "--count=9", "--seed=3", f"--output={out}",
                 "--overwrite"]) == 0
    assert len(records(out)) == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


@pytest.mark.parametrize("argv, message", [
    (["--task=parity", "--hops=3"], "--hops: applies to --task chains, not --task parity"),
    (["--task=chains", "--group=A5"], "--group: applies to --task permutations"),
    (["--task=chains", "--hops=0"], "--hops 0: must be >= 1"),
    (["--task=chains", "--values=11"], "--values 11: must be in 2"),
    (["--task=retrieval", "--pairs=3", "--queries=4"], "--queries 4: must be in 1 … --pairs 3"),
    (["--task=chains", "--pairs=3"], "--pairs: applies to --task retrieval, not --task chains"),
    (["--task=chains", "--hops=200", "--chains=4"], "lower --chains or --hops"),
    (["--task=permutations", "--length=0"], "--length 0"),
    (["--task=parity", "--count=0"], "--count: 0, must be >= 1"),
    (["--task=parity", "--seed=-1"], "--seed: -1, must be >= 0"),
])
def test_make_bad_options_name_the_flag(tmp_path, capsys, argv, message):
    argv = ["tasks", "make", "--count=3", "--seed=0", f"--output={tmp_path / 'x.jsonl'}", *argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


def test_read_task_file_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = next(generate_documents(Parity(length=3), 1, seed=0)).to_json()
    path.write_text(good + "\n\n" + '{"segments": [{"text": "x"}]}\n')
    with pytest.raises(TaskFileError, match=r"bad.jsonl:3: segments\[0\]"):
        list(read_task_file(path))
    path.write_text(good + "\nnot json\n")
    with pytest.raises(TaskFileError, match=r"bad.jsonl:2: not valid JSON"):
        list(read_task_file(path))
    path.write_text('{"segments": [{"text": "a=", "loss": false}, {"text": "1", "loss": true}]}\n')
    (document,) = read_task_file(path)  # not generated: grouped under the file name
    assert document.task == "bad" and document.chance is None and document.answers == ["1"]


# ---- scoring ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(files, tmp_path_factory) -> Path:
    """A 320-piece tokenizer trained on the generated files through their `text` field, as
    users train one."""
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tasks_tok"), list(files.values()),
                                vocab_size=320)


@pytest.fixture(scope="module")
def encoded(files, tokenizer) -> dict[str, list[EncodedDocument]]:
    processor = load_tokenizer(tokenizer)
    return {name: encode_documents(read_task_file(path), processor)
            for name, path in files.items()}


def oracle(documents: list[EncodedDocument]):
    """Predicts every next token right: looks each row (without its padding) up among the
    documents and returns the tokens that follow."""
    by_input = {tuple(d.tokens[:d.input_length].tolist()): d.tokens for d in documents}

    def predict(tokens: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(tokens)
        for row, ids in enumerate(tokens.tolist()):
            while ids and ids[-1] == 0:  # pad id 0 never occurs in encoded text
                ids.pop()
            out[row, :len(ids)] = torch.from_numpy(by_input[tuple(ids)][1:len(ids) + 1])
        return out

    return predict


def constant_answer(answer: list[int], marker: int):
    """Answers `answer` (token ids) after every `marker` token, whatever the document says; a
    one-token answer is the constant predictor itself."""
    fixed = torch.tensor(answer)

    def predict(tokens: torch.Tensor) -> torch.Tensor:
        if len(answer) == 1:
            return torch.full_like(tokens, answer[0])
        out = torch.zeros_like(tokens)
        for row, col in (tokens == marker).nonzero().tolist():
            span = min(len(answer), tokens.shape[1] - col)
            out[row, col:col + span] = fixed[:span]
        return out

    return predict


def within_chance(correct: int, answers: int, chance: float) -> bool:
    """|accuracy - chance| below 4 standard errors of a binomial proportion: a predictor at
    chance fails it with probability < 1e-4, and the seeds are fixed, so the test is not flaky;
    a generator whose answers leak (or are skewed) by more than that fails it."""
    return abs(correct / answers - chance) < 4 * math.sqrt(chance * (1 - chance) / answers)


@pytest.mark.parametrize("name", VARIANTS)
def test_oracle_scores_every_answer(encoded, name):
    documents = encoded[name]
    (score,) = score_documents(documents, oracle(documents), batch_size=7).values()
    assert score.documents == SOLVED and score.correct == score.answers
    assert score.answers == sum(len(answer_spans(d.mask)) for d in documents)
    assert score.accuracy == 1.0


@pytest.mark.parametrize("name", ["chains-n8", "chains-n3-k5-v4", "parity", "parity-L5"])
def test_constant_predictor_scores_chance(encoded, tokenizer, name):
    processor = load_tokenizer(tokenizer)
    documents = encoded[name]
    values = 4 if name == "chains-n3-k5-v4" else 2 if name.startswith("parity") else 10
    total = 0
    for value in range(values):
        (token,) = processor.encode(str(value))
        (score,) = score_documents(documents, constant_answer([token], -1)).values()
        assert score.chance == 1 / values
        assert within_chance(score.correct, score.answers, score.chance), (value, score)
        total += score.correct
    assert total == score.answers  # each answer is exactly one of the values


@pytest.mark.parametrize("name", ["S5", "A5"])
def test_constant_permutation_scores_chance(encoded, tokenizer, name):
    processor = load_tokenizer(tokenizer)
    (marker,) = processor.encode(">")
    documents = encoded[name][:50]  # 120 predictors: the sum check below needs every one
    total = 0
    for element in permutations("12345"):
        answer = processor.encode("".join(element))
        (score,) = score_documents(documents, constant_answer(answer, marker),
                                   batch_size=50).values()
        total += score.correct
        if element in {tuple("12345"), tuple("21345"), tuple("53412")}:
            odd = element == tuple("21345")
            chance = 0.0 if (odd and name == "A5") else score.chance
            assert score.chance == (1 / 60 if name == "A5" else 1 / 120)
            assert (score.correct == 0 if chance == 0.0
                    else within_chance(score.correct, score.answers, chance)), (element, score)
    assert total == score.answers  # each answer is exactly one element


def test_exact_match_needs_every_token_of_an_answer():
    tokens = np.array([5, 6, 7, 8, 9, 10, 11, 2], dtype=np.int32)
    mask = np.array([0, 1, 1, 0, 1, 0, 1, 0], dtype=np.uint8)
    assert answer_spans(mask) == [(1, 3), (4, 5), (6, 7)]
    document = EncodedDocument("t", tokens, mask, 0.5)
    assert document.input_length == 6

    def one_wrong(inputs: torch.Tensor) -> torch.Tensor:
        out = torch.from_numpy(tokens[1:inputs.shape[1] + 1].astype(np.int64))[None].clone()
        out[0, 1] = 0  # the second token of the first answer
        return out

    (score,) = score_documents([document], one_wrong).values()
    assert (score.answers, score.correct) == (3, 2)
    with pytest.raises(ValueError, match="scores its first token"):
        score_documents([EncodedDocument("t", tokens, np.roll(mask, -1))], one_wrong)
    with pytest.raises(ValueError, match="one task name must be one variant"):
        score_documents([document, EncodedDocument("t", tokens, mask, 0.1)], one_wrong)


def test_scores_do_not_depend_on_batching(encoded):
    documents = encoded["chains-n8"][:40] + encoded["parity-L5"][:40] + encoded["S5"][:40]

    def echo(tokens: torch.Tensor) -> torch.Tensor:  # causal: output t depends on token t only
        return (tokens * 7 + 3) % 320

    results = [{k: v.as_dict() for k, v in score_documents(documents, echo, batch_size=b).items()}
               for b in (1, 6, 120)]
    assert results[0] == results[1] == results[2] and len(results[0]) == 3


def test_encoding_is_the_tokenizers(files, tokenizer):
    processor = load_tokenizer(tokenizer)
    document = next(read_task_file(files["chains-n8"]))
    (encoded,) = encode_documents([document], processor)
    tokens, mask = encode_segments(processor, document.segments)
    assert np.array_equal(encoded.tokens, tokens) and np.array_equal(encoded.mask, mask)
    # Answers are one token each, and the model's context holds a default chains-n8 document.
    assert [e - b for b, e in answer_spans(mask)] == [1, 1] and len(tokens) <= 128


# ---- end to end ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def exported(tokenizer, tmp_path_factory) -> Path:
    """A tiny random beta12 model as a `megabeta export` file that records the tokenizer."""
    processor = load_tokenizer(tokenizer)
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=processor.vocab_size, d_model=32, hidden_dim=64,
                         num_heads=2, num_layers=2, block_size=16, depth_window=1,
                         max_seq_len=128)
    model = build_model(config)
    path = tmp_path_factory.mktemp("tasks_model") / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path),
              metadata={"format": EXPORT_FORMAT, "model_config": json.dumps(config.__dict__),
                        "tokenizer": json.dumps({"path": str(tokenizer),
                                                 "sha256": file_sha256(tokenizer)})})
    return path


def test_eval_cli_reports_and_writes_json(files, tokenizer, exported, tmp_path, capsys):
    out = tmp_path / "results" / "tasks.json"
    status = main(["tasks", "eval", f"--checkpoint={exported}", "--tasks",
                   str(files["chains-n8"]), str(files["parity-L5"]), "--max-documents=50",
                   "--batch-size=16", f"--json={out}"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    report = json.loads(out.read_text())
    rows = {row["task"]: row for row in report["results"]}
    assert list(rows) == ["chains-n8-k2-v10", "parity-L5"]
    assert rows["chains-n8-k2-v10"]["documents"] == 50 and rows["chains-n8-k2-v10"]["answers"] == 100
    assert rows["parity-L5"]["answers"] == 50 and rows["parity-L5"]["chance"] == 0.5
    assert report["tokenizer"] == {"path": str(tokenizer), "sha256": file_sha256(tokenizer)}
    for task, row in rows.items():
        assert row["accuracy"] == row["correct"] / row["answers"]
        assert task in captured.out
    # The same figures as scoring the model in memory.
    processor = load_tokenizer(tokenizer)
    direct = evaluate_tasks(load_model(exported), processor,
                            [files["chains-n8"], files["parity-L5"]], max_documents=50)
    assert [s.as_dict() for s in direct] == report["results"]


def test_eval_cli_refuses_documents_beyond_the_context(files, exported, capsys):
    status = main(["tasks", "eval", f"--checkpoint={exported}",
                   f"--tasks={files['chains-n32']}", "--max-documents=3"])
    err = capsys.readouterr().err
    assert status == 2 and "max_seq_len = 128" in err and str(files["chains-n32"]) in err


def test_eval_cli_bad_input(files, exported, tmp_path, capsys):
    status = main(["tasks", "eval", f"--checkpoint={exported}",
                   f"--tasks={tmp_path / 'none.jsonl'}"])
    assert status == 2 and "none.jsonl: no such file" in capsys.readouterr().err
    status = main(["tasks", "eval", f"--checkpoint={tmp_path / 'none.safetensors'}",
                   f"--tasks={files['parity']}"])
    assert status == 2 and "--checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["tasks", "eval", f"--checkpoint={exported}", f"--tasks={files['parity']}",
              "--batch-size=0"])
    assert "--batch-size: 0" in capsys.readouterr().err
