"""Issue 45, items 1, 2 and 5 and the bad-input rules: `megabeta export --format hf` writes a
folder transformers loads (config.json with auto_map, safetensors sharded above a size with an
index, generation_config.json, the code, the tokenizer), megabeta loads it back bit for bit
(`load_model`, `megabeta generate`), and bad input is one `error:` line and exit 2 with nothing
left behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("transformers")

from support.cli import cli
from support.hf_helpers import export_folder, save_export
from support.model_helpers import tiny_model, tokens

from data_tools.tokenizer import load_tokenizer
from megabeta.checkpoint import CheckpointError
from megabeta.checkpoint.export import load_model, read_source
from megabeta.cli import main
from megabeta.hf import folder as hf_folder
from megabeta.hf import layout

VOCAB = 320
"""The sentencepiece tokenizers' vocabulary (tests/unit/hf/conftest.py): every id the model
generates decodes."""


@pytest.fixture(scope="module")
def model():
    return tiny_model(torch.float32, vocab_size=VOCAB, max_seq_len=64, block_size=4,
                      num_kv_heads=2, qk_norm=True, tie_embedding=False).eval()


@pytest.fixture(scope="module")
def source(model, tokenizer_files, tmp_path_factory) -> Path:
    """A megabeta export of `model` recording the sentencepiece tokenizer and run settings."""
    path = tmp_path_factory.mktemp("hf_source") / "m.safetensors"
    return save_export(model, path, tokenizer_files["sp_bpe"],
                       data={"path": ["data/x"], "seq_len": 32, "val_fraction": 0.1})


@pytest.fixture(scope="module")
def folder(source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hf_folder") / "m-hf"
    assert main(["export", "--format", "hf", "--checkpoint", str(source), "--output",
                 str(out)]) == 0
    return out


def test_the_folder_holds_what_transformers_reads(folder, model, source):
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(["config.json", "generation_config.json", "model.safetensors",
                            "configuration_beta12.py", "modeling_beta12.py", "tokenizer.json",
                            "tokenizer.model", "tokenizer_config.json",
                            "special_tokens_map.json"])
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "beta12"
    assert config["architectures"] == ["Beta12ForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_beta12.Beta12ForCausalLM"
    assert config["hidden_size"] == 32 and config["num_key_value_heads"] == 2
    assert config["tie_word_embeddings"] is False and config["block_size"] == 4
    assert config["megabeta"]["data"]["seq_len"] == 32
    package = Path(hf_folder.__file__).parent
    for name in hf_folder.CODE_FILES:
        assert (folder / name).read_bytes() == (package / name).read_bytes()
        assert "megabeta" not in "".join(line for line in (folder / name).read_text()
                                         .splitlines() if line.startswith(("import", "from")))
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"] == load_tokenizer(
        read_source(folder).tokenizer["path"]).eos_id
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == {layout.hf_name(k) for k in model.state_dict()}
        assert torch.equal(f.get_tensor("lm_head.weight"), model.output.weight)


def test_megabeta_loads_the_folder_back_exactly(folder, model):
    back = load_model(folder)
    assert back.config.identity() == model.config.identity()
    for (name, p), q in zip(back.state_dict().items(), model.state_dict().values()):
        assert torch.equal(p, q), name
    source = read_source(folder)
    assert source.data["seq_len"] == 32 and source.settings_from.endswith("config.json")


def test_transformers_loads_the_folder_in_float32_and_bfloat16(folder, model):
    from transformers import AutoModelForCausalLM

    x = tokens(2, 23)
    with torch.no_grad():
        want = model(x)
        hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        assert next(hf.parameters()).dtype == torch.float32
        torch.testing.assert_close(hf(x).logits, want, atol=1e-5, rtol=0)
        half = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True,
                                                    torch_dtype=torch.bfloat16)
        assert next(half.parameters()).dtype == torch.bfloat16
        assert (half(x).logits.float() - want).abs().max() < 0.02 * want.abs().max()


def test_weights_above_the_shard_size_are_sharded_with_an_index(source, model, tmp_path):
    out = tmp_path / "sharded"
    assert main(["export", "--format", "hf", "--checkpoint", str(source), "--output", str(out),
                 "--max-shard-size", "20KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p for p in out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == {layout.hf_name(k) for k in model.state_dict()}
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert index["metadata"]["total_size"] == total
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            size = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
            assert size <= 20_000 or len(list(f.keys())) == 1
    back = load_model(out)
    for p, q in zip(back.state_dict().values(), model.state_dict().values()):
        assert torch.equal(p, q)


def test_generate_cli_on_the_folder_matches_transformers_generate(folder, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "alpha beta gamma"
    status, out, err = cli(capsys, "generate", "--checkpoint", str(folder), "--prompt", prompt,
                           "--temperature", "0", "--max-new-tokens", "12", "--no-stop-at-eod")
    assert status == 0, err
    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    new = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert out.rstrip("\n") == prompt + tokenizer.decode(new[0, ids.shape[1]:])


def test_an_hf_folder_exports_again(folder, tmp_path):
    """A folder is a checkpoint like any other: it exports to both formats."""
    again = tmp_path / "again"
    assert main(["export", "--format", "hf", "--checkpoint", str(folder), "--output",
                 str(again)]) == 0
    assert (again / "model.safetensors").read_bytes() == (folder / "model.safetensors"
                                                          ).read_bytes()
    single = tmp_path / "m.safetensors"
    assert main(["export", "--checkpoint", str(folder), "--output", str(single)]) == 0
    assert read_source(single).tokenizer == read_source(folder).tokenizer


def test_a_copy_saved_by_transformers_loads_back(folder, model, tmp_path):
    """A fine-tuned model saved with `save_pretrained` (which leaves out config keys at their
    default, tests/unit/hf/test_hf_layout.py, and the tokenizer.model it does not know) is a
    model megabeta loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        hf.model.norm.weight.mul_(2)  # a stand-in for fine-tuning
    hf.save_pretrained(tmp_path / "tuned")
    AutoTokenizer.from_pretrained(folder).save_pretrained(tmp_path / "tuned")
    back = load_model(tmp_path / "tuned")
    assert back.config.identity() == model.config.identity()
    assert torch.equal(back.norm.weight, model.norm.weight * 2)
    assert torch.equal(back.layers[1].attention.wk.weight, model.layers[1].attention.wk.weight)
    tokenizer = read_source(tmp_path / "tuned").tokenizer
    assert tokenizer == {"path": str(tmp_path / "tuned" / "tokenizer.json")}
    assert load_tokenizer(tokenizer["path"]).encode("alpha beta\n").tolist() == load_tokenizer(
        folder / "tokenizer.model").encode("alpha beta\n").tolist()


# ---- bad input ---------------------------------------------------------------------------------
def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:") or "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_an_unknown_format_is_one_line(source, tmp_path, capsys):
    status, _, err = cli(capsys, "export", "--format", "onnx", "--checkpoint", str(source),
                         "--output", str(tmp_path / "x"))
    assert status == 2
    assert "invalid choice: 'onnx'" in _one_error_line(err)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("what", ["directory", "text file", "dataset"])
def test_a_checkpoint_that_is_not_a_model_is_one_line(what, tmp_path, capsys, tiny_data):
    bad = {"directory": tmp_path / "empty_dir", "text file": tmp_path / "notes.txt",
           "dataset": Path(str(tiny_data[0]) + ".bin")}[what]
    if what == "directory":
        bad.mkdir()
    elif what == "text file":
        bad.write_text("hello")
    out = tmp_path / "out"
    status, _, err = cli(capsys, "export", "--format", "hf", "--checkpoint", str(bad),
                         "--output", str(out))
    assert status == 2
    line = _one_error_line(err)
    assert f"{bad} is not a model" in line and "--format hf" in line
    assert not out.exists() and [p.name for p in tmp_path.iterdir()
                                 if p.name.startswith(".out")] == []


def test_a_folder_whose_config_does_not_match_its_weights_is_one_line(folder, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in folder.iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 64
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="does not match its weights"):
        load_model(broken)
    for argv in (["generate", "--checkpoint", str(broken), "--prompt", "alpha",
                  "--max-new-tokens", "4"],
                 ["export", "--format", "hf", "--checkpoint", str(broken), "--output",
                  str(tmp_path / "re")]):
        status, _, err = cli(capsys, *argv)
        assert status == 2
        line = _one_error_line(err)
        assert "config.json does not match its weights" in line and "w1" in line
    assert not (tmp_path / "re").exists()
    config["model_type"] = "llama"
    (broken / "config.json").write_text(json.dumps(config))
    status, _, err = cli(capsys, "generate", "--checkpoint", str(broken), "--prompt", "alpha")
    assert status == 2 and "model_type 'llama'" in _one_error_line(err)


def test_an_existing_output_is_refused_untouched(source, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    status, _, err = cli(capsys, "export", "--format", "hf", "--checkpoint", str(source),
                         "--output", str(out))
    assert status == 2 and "already exists" in _one_error_line(err)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]


def test_a_failure_while_writing_leaves_nothing_behind(source, tmp_path, monkeypatch, capsys):
    calls = []

    def fail_second(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("No space left on device")
        return save_file(tensors, filename, metadata=metadata)

    from safetensors.torch import save_file

    monkeypatch.setattr(hf_folder, "save_file", fail_second)
    status, _, err = cli(capsys, "export", "--format", "hf", "--checkpoint", str(source),
                         "--output", str(tmp_path / "out"), "--max-shard-size", "20KB")
    assert status == 2 and "No space left on device" in _one_error_line(err)
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []


def test_a_tokenizer_that_is_not_the_models_is_refused(source, tokenizer_files, tmp_path,
                                                       capsys):
    status, _, err = cli(capsys, "export", "--format", "hf", "--checkpoint", str(source),
                         "--output", str(tmp_path / "o"), "--tokenizer",
                         str(tokenizer_files["sp_unigram"]))
    assert status == 2 and "is not the tokenizer the model was trained with" in (
        _one_error_line(err))
    unrecorded = save_export(tiny_model(torch.float32, vocab_size=VOCAB),
                             tmp_path / "u.safetensors")
    status, _, err = cli(capsys, "export", "--format", "hf", "--checkpoint", str(unrecorded),
                         "--output", str(tmp_path / "o"))
    assert status == 2 and "pass --tokenizer" in _one_error_line(err)
    status, _, err = cli(capsys, "export", "--checkpoint", str(source), "--output",
                         str(tmp_path / "o.safetensors"), "--max-shard-size", "1GB")
    assert status == 2 and "only with --format hf" in _one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["u.safetensors"]


def test_export_folder_helper_round_trip(tokenizer_files, tmp_path):
    """The tests' helper writes what the CLI writes."""
    wider = tiny_model(torch.float32, vocab_size=400)  # the tokenizer.json has 400 pieces
    out = export_folder(wider, tokenizer_files["hf_bpe"], tmp_path)
    assert (out / "tokenizer.json").read_bytes() == tokenizer_files["hf_bpe"].read_bytes()
    assert not (out / "tokenizer.model").exists()


def test_export_needs_no_transformers_and_names_the_extra_it_needs(source, tmp_path, capsys,
                                                                    monkeypatch):
    """Writing the folder imports no transformers; converting a sentencepiece model needs
    tokenizers, and without it the export says which extra to install."""
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    assert main(["export", "--format", "hf", "--checkpoint", str(source), "--output",
                 str(tmp_path / "plain")]) == 0
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    status, _, err = cli(capsys, "export", "--format", "hf", "--checkpoint", str(source),
                         "--output", str(tmp_path / "no_tokenizers"))
    assert status == 2
    assert "pip install 'megabeta[hf]'" in _one_error_line(err)
    assert not (tmp_path / "no_tokenizers").exists()
