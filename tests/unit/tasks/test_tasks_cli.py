"""`megabeta tasks make | eval` (megabeta/tasks/cli.py): make writes its file atomically and names
a bad flag; eval reports and writes JSON for a tiny real model end to end, the same figures as
scoring it in memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support.tasks_helpers import make, records

from data_tools.tokenizer import load_tokenizer
from megabeta.checkpoint.export import EXPORT_FORMAT, load_model
from megabeta.cli import main
from megabeta.data import file_sha256
from megabeta.model import ModelConfig, build_model
from megabeta.tasks.evaluate import evaluate_tasks


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
    (["--task=retrieval", "--pairs=3", "--queries=4"], "--queries 4: must be in 1 … --pairs 3"),
    (["--task=chains", "--pairs=3"], "--pairs: applies to --task retrieval, not --task chains"),
    (["--task=chains", "--hops=0"], "--hops 0: must be >= 1"),
    (["--task=chains", "--values=11"], "--values 11: must be in 2"),
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
