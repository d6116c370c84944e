"""Issue 19, items 1-3 and 8: bad input to `megabeta eval`, `megabeta generate`, `megabeta train`'s
start-up, `megabeta bench` and the JSONL reader, as a user meets it. Each gets exit code 2 (or a
documented warning) and one `error:` line naming the flag, field or file and what to do, never a
traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.corpus import documents, tokenize, train_tiny_tokenizer, write_jsonl
from safetensors import safe_open

from megabeta.checkpoint.export import read_source
from megabeta.cli import main
from megabeta.data import build_train_val, file_sha256
from support.cli import cli
from support.train_helpers import TINY, launch

STEP = "step_00000003"


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory) -> Path:
    """A 3-step tiny_cpu run (max_seq_len 128, data.seq_len 32, val_fraction 0.1) that names no
    data.tokenizer, as tiny_cpu.toml does not: the tokenizer is recorded from the sidecar."""
    prefix, _ = tiny_data
    run_dir = tmp_path_factory.mktemp("cli_bad") / "run"
    launch([*TINY, f"--data.path={prefix}", f"--run_dir={run_dir}", "--train.steps=3"])
    return run_dir


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli_bad_export") / "m.safetensors"
    assert main(["export", f"--checkpoint={run / 'checkpoints' / STEP}", f"--output={out}"]) == 0
    return out


@pytest.fixture(scope="module")
def other(tmp_path_factory) -> tuple[Path, Path]:
    """(tokenizer, dataset prefix) of another tokenizer (same vocabulary size, other pieces)."""
    root = tmp_path_factory.mktemp("other_tok")
    corpus = write_jsonl(root / "other.jsonl", documents(120, seed=7))
    model = train_tiny_tokenizer(root, [corpus], vocab_size=300, seed=1)
    assert tokenize(model, [corpus], root / "other") == 0
    return model, root / "other"


def refused(capsys, *argv: str) -> str:
    """stderr of a command that must fail cleanly."""
    status, out, err = cli(capsys, *argv)
    assert status == 2, (status, out, err)
    assert "error:" in err and "Traceback" not in err + out, err
    return err


def copied_checkpoint(run: Path, target: Path, **state_changes) -> Path:
    """The run's checkpoint copied out of its run directory (so no config.toml is found), its
    train_state.json changed as given (None deletes a key: an older checkpoint)."""
    shutil.copytree(run / "checkpoints" / STEP, target)
    state_file = target / "train_state.json"
    state = json.loads(state_file.read_text())
    for key, value in state_changes.items():
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value
    state_file.write_text(json.dumps(state))
    return target


# ---- 1. eval defaults from the checkpoint's run -------------------------------------------------
def test_eval_takes_its_defaults_from_the_run(run, capsys):
    status, out, err = cli(capsys, "eval", f"--checkpoint={run / 'checkpoints' / STEP}",
                           "--batches=2")
    assert status == 0, err
    assert "ppl" in out and "Traceback" not in err
    assert "seq_len 32 | val_fraction 0.1" in err and str(run / "config.toml") in err


def test_eval_of_an_export_takes_its_defaults_from_the_metadata(run, exported, tiny_data,
                                                                capsys):
    prefix, tokenizer = tiny_data
    source = read_source(exported)
    assert source.data == {"path": [str(prefix)], "seq_len": 32, "val_fraction": 0.1,
                           "align": "packed", "document_mask": False}
    assert source.tokenizer["sha256"] == file_sha256(tokenizer)
    with safe_open(str(exported), framework="pt") as f:
        assert f.metadata()["format"] == "megabeta-export/1"
    status, out, err = cli(capsys, "eval", f"--checkpoint={exported}", "--batches=2")
    assert status == 0 and "ppl" in out, err
    assert "seq_len 32" in err and "metadata" in err


def test_eval_without_a_run_config_defaults_to_the_models_context(run, tiny_data, tmp_path,
                                                                  capsys):
    """The issue's case: a tiny_cpu model (max_seq_len 128) and no --seq-len crashed at 256."""
    prefix, _ = tiny_data
    checkpoint = copied_checkpoint(run, tmp_path / "alone")
    status, out, err = cli(capsys, "eval", f"--checkpoint={checkpoint}", f"--data.path={prefix}",
                           "--val-fraction=0.1", "--batches=2")
    assert status == 0 and "ppl" in out, err
    assert "seq_len 128" in err


def test_eval_seq_len_beyond_the_model_names_both(run, capsys):
    err = refused(capsys, "eval", f"--checkpoint={run / 'checkpoints' / STEP}", "--seq-len=256")
    assert "--seq-len 256" in err and "max_seq_len = 128" in err and "--seq-len 128" in err


@pytest.mark.parametrize("flags,named", [
    (["--batch-size=0"], "--batch-size"),
    (["--batches=-1"], "--batches"),
    (["--val-fraction=1.5"], "--val-fraction"),
    (["--seq-len=0"], "--seq-len 0"),
])
def test_eval_bad_numbers(flags, named, run, capsys):
    err = refused(capsys, "eval", f"--checkpoint={run / 'checkpoints' / STEP}", *flags)
    assert named in err


def test_eval_without_any_dataset_says_what_to_pass(run, tmp_path, capsys):
    checkpoint = copied_checkpoint(run, tmp_path / "alone")
    err = refused(capsys, "eval", f"--checkpoint={checkpoint}")
    assert "--data.path=PREFIX" in err


def test_eval_and_generate_of_a_missing_checkpoint(tmp_path, capsys):
    for command in (["eval"], ["generate", "--prompt=x"]):
        err = refused(capsys, *command, f"--checkpoint={tmp_path / 'nowhere'}")
        assert str(tmp_path / "nowhere") in err and "megabeta export" in err


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_help_shows_every_default(command, capsys):
    status, out, _ = cli(capsys, command, "--help")
    assert status == 0
    options = out.split("options:")[1].split("\n\n")[0]
    blocks, current = [], ""
    for line in options.splitlines():
        if line.startswith("  -"):
            blocks.append(current)
            current = line
        else:
            current += " " + line.strip()
    blocks.append(current)
    for block in (b for b in blocks if b.strip()):
        if not block.startswith("  -h"):
            assert "default" in block or "required" in block, block
    for flag in (["--batch-size", "--seq-len", "--val-fraction"] if command == "eval"
                 else ["--top-k", "--top-p", "--seed", "--max-new-tokens"]):
        assert flag in options


# ---- 2. generate past the context ----------------------------------------------------------------
def test_generate_prompt_longer_than_the_context(run, capsys):
    err = refused(capsys, "generate", f"--checkpoint={run / 'checkpoints' / STEP}",
                  "--prompt=" + "alpha beta gamma delta " * 80, "--max-new-tokens=4")
    assert "model.max_seq_len = 128" in err and "shorten" in err


def test_generate_prompt_plus_new_tokens_beyond_the_context(run, exported, capsys):
    for checkpoint in (run / "checkpoints" / STEP, exported):
        err = refused(capsys, "generate", f"--checkpoint={checkpoint}", "--prompt=alpha beta",
                      "--max-new-tokens=200")
        assert "--max-new-tokens 200" in err and "model.max_seq_len = 128" in err
        assert "or less" in err


def test_generate_exactly_filling_the_context_works(run, tiny_data, capsys):
    import sentencepiece as spm

    prompt_tokens = len(spm.SentencePieceProcessor(model_file=str(tiny_data[1])).encode("alpha"))
    status, out, err = cli(capsys, "generate", f"--checkpoint={run / 'checkpoints' / STEP}",
                           "--prompt=alpha", f"--max-new-tokens={128 - prompt_tokens}",
                           "--temperature=0")
    assert status == 0 and out.startswith("alpha"), err
    err = refused(capsys, "generate", f"--checkpoint={run / 'checkpoints' / STEP}",
                  "--prompt=alpha", f"--max-new-tokens={129 - prompt_tokens}")
    assert f"--max-new-tokens {128 - prompt_tokens} or less" in err


def test_generate_help_documents_the_context_rule(capsys):
    _, out, _ = cli(capsys, "generate", "--help")
    assert "max_seq_len" in out and "nothing is truncated" in out


@pytest.mark.parametrize("flag", ["--top-p=1.5", "--top-p=0", "--top-k=0", "--temperature=-1",
                                  "--max-new-tokens=-3"])
def test_generate_bad_sampling_flags(flag, run, capsys):
    err = refused(capsys, "generate", f"--checkpoint={run / 'checkpoints' / STEP}",
                  "--prompt=alpha", flag)
    assert flag.split("=")[0] in err


def test_generate_empty_prompt(run, capsys):
    err = refused(capsys, "generate", f"--checkpoint={run / 'checkpoints' / STEP}", "--prompt=")
    assert "--prompt" in err


# ---- 3. generation knows its tokenizer -----------------------------------------------------------
def test_the_checkpoint_and_the_export_record_the_tokenizer(run, exported, tiny_data):
    _, tokenizer = tiny_data
    state = json.loads((run / "checkpoints" / STEP / "train_state.json").read_text())
    assert state["tokenizer"] == {"path": str(tokenizer), "sha256": file_sha256(tokenizer)}
    assert read_source(exported).tokenizer == state["tokenizer"]


def test_tokenizer_record_prefers_the_runs_data_tokenizer(tiny_data):
    prefix, tokenizer = tiny_data
    data = build_train_val([prefix], seq_len=32)
    assert data.tokenizer_record() == {"path": str(tokenizer), "sha256": file_sha256(tokenizer)}
    assert data.tokenizer_record(tokenizer)["path"] == str(Path(tokenizer).resolve())


def test_generate_uses_the_recorded_tokenizer(run, exported, capsys):
    for checkpoint in (run / "checkpoints" / STEP, exported):
        status, out, err = cli(capsys, "generate", f"--checkpoint={checkpoint}",
                               "--prompt=alpha beta", "--max-new-tokens=4", "--temperature=0")
        assert status == 0 and out.startswith("alpha beta"), err


def test_generate_refuses_another_tokenizer_unless_forced(run, exported, other, capsys):
    other_tokenizer, _ = other
    for checkpoint in (run / "checkpoints" / STEP, exported):
        err = refused(capsys, "generate", f"--checkpoint={checkpoint}", "--prompt=alpha",
                      f"--tokenizer={other_tokenizer}")
        assert str(other_tokenizer) in err and "--force-tokenizer" in err
    status, out, err = cli(capsys, "generate", f"--checkpoint={exported}", "--prompt=alpha",
                           f"--tokenizer={other_tokenizer}", "--force-tokenizer",
                           "--max-new-tokens=4")
    assert status == 0 and out.startswith("alpha"), err


def test_generate_with_a_tokenizer_that_is_not_a_model(run, tiny_data, tmp_path, capsys):
    _, tokenizer = tiny_data
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a sentencepiece model")
    err = refused(capsys, "generate", f"--checkpoint={run / 'checkpoints' / STEP}",
                  "--prompt=alpha", f"--tokenizer={bad}")
    assert "--force-tokenizer" in err  # another sha256 first
    err = refused(capsys, "generate", f"--checkpoint={run / 'checkpoints' / STEP}",
                  "--prompt=alpha", f"--tokenizer={bad}", "--force-tokenizer")
    assert f"{bad}: not a sentencepiece model" in err
    err = refused(capsys, "generate", f"--checkpoint={run / 'checkpoints' / STEP}",
                  "--prompt=alpha", f"--tokenizer={tmp_path / 'missing.model'}")
    assert "missing.model: no such file" in err


def test_generate_without_a_recorded_tokenizer_says_what_to_pass(run, tmp_path, capsys):
    checkpoint = copied_checkpoint(run, tmp_path / "old", tokenizer=None)
    err = refused(capsys, "generate", f"--checkpoint={checkpoint}", "--prompt=alpha")
    assert "records no tokenizer" in err and "--tokenizer PATH (.model or tokenizer.json)" in err
    assert "(none)" not in err


def test_generate_when_the_recorded_tokenizer_is_gone_or_changed(run, tiny_data, tmp_path,
                                                                 capsys):
    _, tokenizer = tiny_data
    gone = tmp_path / "gone.model"
    checkpoint = copied_checkpoint(run, tmp_path / "gone", tokenizer={
        "path": str(gone), "sha256": file_sha256(tokenizer)})
    err = refused(capsys, "generate", f"--checkpoint={checkpoint}", "--prompt=alpha")
    assert str(gone) in err and "--tokenizer PATH (.model or tokenizer.json)" in err
    changed = tmp_path / "changed.model"
    changed.write_bytes(tokenizer.read_bytes() + b"\0")
    checkpoint = copied_checkpoint(run, tmp_path / "changed", tokenizer={
        "path": str(changed), "sha256": file_sha256(tokenizer)})
    err = refused(capsys, "generate", f"--checkpoint={checkpoint}", "--prompt=alpha")
    assert f"{changed} has changed" in err and "--force-tokenizer" in err


def test_eval_refuses_data_of_another_tokenizer_unless_forced(run, other, capsys):
    other_tokenizer, other_prefix = other
    checkpoint = run / "checkpoints" / STEP
    err = refused(capsys, "eval", f"--checkpoint={checkpoint}", f"--data.path={other_prefix}")
    assert str(other_prefix) in err and "--force-tokenizer" in err
    err = refused(capsys, "eval", f"--checkpoint={checkpoint}", f"--tokenizer={other_tokenizer}")
    assert str(other_tokenizer) in err and "--force-tokenizer" in err
    status, out, err = cli(capsys, "eval", f"--checkpoint={checkpoint}",
                           f"--data.path={other_prefix}", "--force-tokenizer", "--batches=2")
    assert status == 0 and "ppl" in out, err


def test_eval_warns_when_the_data_has_no_sidecar(run, tiny_data, tmp_path, capsys):
    prefix, _ = tiny_data
    bare = tmp_path / "bare"
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{prefix}{suffix}", f"{bare}{suffix}")
    status, out, err = cli(capsys, "eval", f"--checkpoint={run / 'checkpoints' / STEP}",
                           f"--data.path={bare}", "--batches=2")
    assert status == 0 and "ppl" in out, err
    assert f"warning: {bare}.json is missing" in err


# ---- 8. the small ones ---------------------------------------------------------------------------
@pytest.mark.parametrize("line,message", [
    ('{"text": "unterminated', "Unterminated string starting at column 10"),
    ('{"text": "a\tb"}', "Invalid control character at column 12"),
    ('{"text": }', "Expecting value at column 10"),
])
def test_jsonl_error_reads_without_at_at(line, message, tiny_data, tmp_path, capsys):
    from data_tools.cli import main as data_main

    _, tokenizer = tiny_data
    corpus = tmp_path / "broken.jsonl"
    corpus.write_text('{"text": "fine"}\n' + line)  # no newline: else it ends the string
    status = data_main(["tokenize", "--tokenizer", str(tokenizer), "--inputs", str(corpus),
                        "--output-prefix", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert status == 2 and f"{corpus}:2: invalid JSON ({message})" in err, err
    assert "at at" not in err


def test_bench_help_names_megabeta_bench(capsys):
    status, _, err = cli(capsys, "bench", "--help")
    assert status == 0 and "usage: megabeta bench" in err and "python -m" not in err
    for name in ("model", "data", "train"):
        status, out, _ = cli(capsys, "bench", name, "--help")
        assert status == 0 and f"usage: megabeta bench {name}" in out


def train_in_process(capsys, *argv: str) -> str:
    """stderr of `megabeta train ARGV` run here, which must fail cleanly at start-up."""
    from megabeta.train.cli import main as train_main

    status = train_main([*TINY, *argv])
    captured = capsys.readouterr()
    assert status == 2, captured
    assert "Traceback" not in captured.err + captured.out
    return captured.err


@pytest.mark.parametrize("case", ["missing dataset", "missing checkpoint", "small vocabulary",
                                  "other tokenizer", "missing tokenizer"])
def test_a_failed_start_leaves_no_run_directory(case, tiny_data, other, tmp_path, capsys):
    prefix, _ = tiny_data
    run_dir = tmp_path / "runs" / "failed"
    extra = {"missing dataset": [f"--data.path={tmp_path / 'nothing'}"],
             "missing checkpoint": [f"--data.path={prefix}", f"--resume={tmp_path / 'no_ckpt'}"],
             "small vocabulary": [f"--data.path={prefix}", "--model.vocab_size=10"],
             "other tokenizer": [f"--data.path={prefix}", f"--data.tokenizer={other[0]}"],
             "missing tokenizer": [f"--data.path={prefix}",
                                   f"--data.tokenizer={tmp_path / 'gone.model'}"]}[case]
    err = train_in_process(capsys, *extra, f"--run_dir={run_dir}")
    if case == "missing tokenizer":
        assert "data.tokenizer" in err and "gone.model" in err and "no such file" in err
    assert not run_dir.exists() and not run_dir.parent.exists()


def test_a_failed_start_keeps_an_existing_run_directory(tiny_data, tmp_path, capsys):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    train_in_process(capsys, f"--data.path={tmp_path / 'nothing'}", f"--run_dir={run_dir}")
    assert run_dir.is_dir()


def test_missing_sidecar_is_named_as_a_missing_file(tiny_data, tmp_path, capsys):
    prefix, tokenizer = tiny_data
    bare = tmp_path / "bare"
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{prefix}{suffix}", f"{bare}{suffix}")
    # tiny_cpu takes model.vocab_size (-1) from the sidecar
    err = train_in_process(capsys, f"--data.path={bare}", f"--run_dir={tmp_path / 'r1'}")
    assert f"{bare}.json: missing" in err and "megabeta-data tokenize" in err
    assert "--model.vocab_size" in err
    # a run that names its tokenizer checks the data against it through the sidecar
    err = train_in_process(capsys, f"--data.path={bare}", f"--data.tokenizer={tokenizer}",
                           "--model.vocab_size=300", f"--run_dir={tmp_path / 'r2'}")
    assert f"{bare}.json: missing" in err and "megabeta-data tokenize" in err
    # a blend of a dataset with a sidecar and one without names the missing one
    err = train_in_process(capsys, f"--data.path={prefix},{bare}", "--model.vocab_size=300",
                           f"--run_dir={tmp_path / 'r3'}")
    assert f"{bare}.json: missing" in err and "megabeta-data tokenize" in err
    assert "different tokenizers" not in err
