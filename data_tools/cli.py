"""``megabeta-data`` (``python -m data_tools``): train a tokenizer, tokenize, merge, inspect.

Exit status: 0 on success, 2 on bad input or a failed check (the message, printed as ``error: ...``,
names the file or flag and the fix), 130 when interrupted. No failed run leaves files under the
output names.
"""

from __future__ import annotations

import argparse
import sys

from data_tools.corpus import ACCEPTED, BAD_UTF8_POLICIES, SPLIT_MODES, ReadOptions
from data_tools.inspect_dataset import InspectConfig, inspect
from data_tools.merge import MergeConfig, merge
from data_tools.mpi import MPI_MODES, FailedElsewhere
from data_tools.report import report_lines
from data_tools.tokenize_corpus import TokenizeConfig, TokenizeResult, tokenize
from data_tools.train_tokenizer import (
    MODEL_TYPES,
    TOKENIZER_KINDS,
    TokenizerTrainingConfig,
    train_tokenizer,
)
from megabeta.data.errors import DataError

_DESCRIPTION = """\
Offline data preparation for megabeta: train a tokenizer (sentencepiece or byte-level BPE),
tokenize a corpus into a memory-mapped token dataset (Megatron-LM MMIDIDX .bin/.idx plus a JSON
sidecar), merge datasets, and inspect one. Training runs read the datasets with megabeta.data. See docs/data.md."""

_EXAMPLES = """\
examples:
  megabeta-data train-tokenizer --inputs corpus/*.jsonl.gz --vocab-size 32000 --output tok/m
  megabeta-data tokenize --tokenizer tok/m.model --inputs corpus/*.jsonl.gz \\
      --output-prefix data/corpus --workers 8
  megabeta-data tokenize --tokenizer hf/tokenizer.json --inputs corpus/ \\
      --output-prefix data/corpus
  mpirun -n 4 megabeta-data tokenize --tokenizer tok/m.model --inputs corpus/*.jsonl.gz \\
      --output-prefix data/corpus --workers 8
  megabeta-data tokenize --tokenizer tok/m.model --inputs tasks.jsonl \\
      --output-prefix data/tasks --segments-key segments
  megabeta-data merge --inputs data/a data/b --output-prefix data/ab
  megabeta-data inspect data/corpus
  megabeta-data inspect --run runs/x --step 1200"""


class _Formatter(argparse.HelpFormatter):
    """Shows a default where there is one worth showing (not for required or on/off flags)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        shown = not (action.required or action.default is None or action.default is False
                     or action.default == argparse.SUPPRESS)
        return f"{action.help} (default: %(default)s)" if shown else action.help


class _TopFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the examples' line breaks."""


def _add_read_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("reading the inputs")
    group.add_argument("--text-key", default=ReadOptions.text_key, metavar="KEY",
                       help="JSONL field (parquet column) holding each document's text")
    group.add_argument("--split", choices=SPLIT_MODES, default=ReadOptions.split,
                       help="how a .txt file splits into documents: none (whole file), line (one "
                            "per line), paragraph (blank-line separated); a JSONL line is always "
                            "one document")
    group.add_argument("--on-bad-utf8", choices=BAD_UTF8_POLICIES, default=ReadOptions.on_bad_utf8,
                       help="documents with undecodable UTF-8: replace bad bytes with U+FFFD, "
                            "skip the document, or stop with an error; replaced and skipped "
                            "documents are counted and reported at the end")
    group.add_argument("--skip-bad", action="store_true",
                       help="skip a record that is not JSON, lacks the --text-key field (or "
                            "--segments-key) or is null, and the rest of a file that turns out "
                            "corrupt or cut short (.gz, .zst, .parquet) or has no --text-key "
                            "column, counting them (each damaged file with the records read "
                            "from it), instead of stopping with an error naming the file and "
                            "line/row")


def _read_options(args: argparse.Namespace) -> ReadOptions:
    return ReadOptions(args.text_key, args.split, args.on_bad_utf8,
                       getattr(args, "segments_key", None), getattr(args, "keep_empty", False),
                       args.skip_bad)


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--overwrite", action="store_true",
                        help="replace existing output files instead of refusing")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar or summary (the bar is also off when stderr is not "
                             "a terminal); what was skipped or cut is still said")


def _say(args: argparse.Namespace, *lines: str) -> None:
    if not args.quiet:
        for line in lines:
            print(line, file=sys.stderr)


def _run_train_tokenizer(args: argparse.Namespace) -> int:
    config = TokenizerTrainingConfig(
        inputs=args.inputs, output=args.output, vocab_size=args.vocab_size,
        model_type=args.model_type, kind=args.kind, max_sentences=args.max_sentences,
        seed=args.seed,
        character_coverage=args.character_coverage, num_threads=args.num_threads,
        read=_read_options(args), overwrite=args.overwrite, quiet=args.quiet)
    sidecar = train_tokenizer(config)
    report = sidecar["report"]
    written, algorithm = ((".tokenizer.json, .tokenizer.meta.json", "byte-level BPE")
                          if args.kind == "bpe"
                          else (".model, .vocab, .model.json", sidecar["model_type"]))
    _say(args, f"wrote {args.output}{written}: {algorithm} "
               f"vocabulary of {sidecar['vocab_size']} from {sidecar['sentences_sampled']:,} of "
               f"{sidecar['lines_seen']:,} lines; pad {sidecar['pad_id']}, bos "
               f"{sidecar['bos_id']}, eos {sidecar['eos_id']}, unk {sidecar['unk_id']}; sha256 "
               f"{sidecar['sha256']}")
    if sidecar["vocab_size"] < args.vocab_size:
        # sentencepiece refuses a size its sample cannot fill; tokenizers' BPE stops short.
        print(f"warning: --vocab-size {args.vocab_size} asked for, but the sample has no pair "
              f"left to merge at {sidecar['vocab_size']} tokens: the tokenizer has "
              f"{sidecar['vocab_size']}; give more text, or ask for that size", file=sys.stderr)
    _warn_skipped(report)
    return 0


def _warn_skipped(report: dict) -> None:
    """What was skipped, repaired or cut, on stderr even with --quiet: nothing given is dropped
    without a count."""
    for line in report_lines(report):
        print(line, file=sys.stderr)


def _run_tokenize(args: argparse.Namespace) -> int:
    config = TokenizeConfig(
        tokenizer=args.tokenizer, inputs=args.inputs, output_prefix=args.output_prefix,
        workers=args.workers, chunk_bytes=max(1, int(args.chunk_mb * 1e6)),
        read=_read_options(args), mpi=args.mpi, overwrite=args.overwrite, quiet=args.quiet)
    result = tokenize(config)
    if result.rank == 0:
        _summarize_tokenize(args, result)
    return 0


def _summarize_tokenize(args: argparse.Namespace, result: TokenizeResult) -> None:
    sidecar, seconds = result.sidecar, max(result.seconds, 1e-9)
    _say(args, f"wrote {args.output_prefix}{_files_written(sidecar)}: "
               f"{sidecar['num_documents']:,} documents, {sidecar['num_tokens']:,} "
               f"{sidecar['dtype']} tokens{_scored(sidecar)} from "
               f"{_size(result.input_bytes)} in {seconds:.1f} s "
               f"({sidecar['num_documents'] / seconds:,.0f} docs/s, "
               f"{_size(result.input_bytes / seconds)}/s)")
    _warn_skipped(sidecar["report"])


def _size(nbytes: float) -> str:
    """Bytes in the unit that shows them: kB below a megabyte (117.3 kB, not 0.1 MB)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.1f} {unit}"
    return f"{nbytes:,.0f} bytes"


def _files_written(sidecar: dict) -> str:
    return ".bin, .idx, .mask, .json" if "loss_mask" in sidecar else ".bin, .idx, .json"


def _scored(sidecar: dict) -> str:
    mask = sidecar.get("loss_mask")
    return f" ({mask['scored_tokens']:,} scored)" if mask else ""


def _run_merge(args: argparse.Namespace) -> int:
    sidecar = merge(MergeConfig(args.inputs, args.output_prefix, args.overwrite))
    _say(args, f"wrote {args.output_prefix}{_files_written(sidecar)}: "
               f"{sidecar['num_documents']:,} documents, {sidecar['num_tokens']:,} "
               f"tokens{_scored(sidecar)} from {len(args.inputs)} datasets")
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    wanted = [f"--{name}" for name in ("step", "position", "sample")
              if getattr(args, name) is not None]
    if (args.prefix is None) == (args.run_dir is None):
        args.parser.error("pass a dataset PREFIX, or --run RUN_DIR with --step, --position or "
                          "--sample (not both)")
    if args.run_dir is None:
        if wanted:
            args.parser.error(f"{wanted[0]} picks a sample of a training run: add --run RUN_DIR "
                              "(for documents of a dataset use --samples)")
    else:
        if not wanted:
            args.parser.error("--run needs --step N, --position P or --sample I: which "
                              "samples of the run to show")
        # Rebuilding a run's data needs megabeta's config, which imports torch: only here.
        from data_tools.inspect_run import RunQuery, inspect_run

        inspect_run(RunQuery(args.run_dir, args.step, args.position, args.sample,
                             args.tokenizer), sys.stdout)
        return 0
    failures = inspect(InspectConfig(args.prefix, args.tokenizer, args.samples,
                                     args.sample_tokens), sys.stdout)
    if failures:
        print(f"error: {len(failures)} check(s) failed for {args.prefix} (see above)",
              file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megabeta-data", description=_DESCRIPTION,
                                     epilog=_EXAMPLES, formatter_class=_TopFormatter)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    train = commands.add_parser(
        "train-tokenizer", formatter_class=_Formatter,
        help="train a tokenizer: sentencepiece (OUTPUT.model) or byte-level BPE "
             "(OUTPUT.tokenizer.json)",
        description="Train a sentencepiece model (BPE or unigram) whose decode gives the text "
                    "back exactly: no normalization, spaces/tabs/newlines kept, byte fallback. "
                    "Special ids are fixed: pad 0, bos 1, eos 2, unk 3. At most --max-sentences "
                    "lines are sampled (seeded reservoir sampling), so memory stays bounded and "
                    "the same inputs, seed and --num-threads give the same model. With --kind "
                    "bpe: a byte-level BPE (Hugging Face tokenizers) saved as "
                    "OUTPUT.tokenizer.json; every byte encodes (no unknown token), digits are "
                    "split, special tokens pad 0, bos 1, eos 2.")
    train.add_argument("--inputs", nargs="+", required=True, metavar="FILE",
                       help=f"training text, files, directories or globs: {ACCEPTED}")
    train.add_argument("--vocab-size", type=int, required=True, metavar="N",
                       help="vocabulary size, everything included: sentencepiece's 4 specials, "
                            "2 whitespace and 256 byte pieces (so > 262); --kind bpe's 3 specials "
                            "and 256 bytes (so > 259)")
    train.add_argument("--output", required=True, metavar="PREFIX",
                       help="writes PREFIX.model, PREFIX.vocab and PREFIX.model.json; with "
                            "--kind bpe PREFIX.tokenizer.json and PREFIX.tokenizer.meta.json")
    train.add_argument("--kind", choices=TOKENIZER_KINDS, default=TokenizerTrainingConfig.kind,
                       help="sentencepiece: OUTPUT.model (with .vocab and .model.json); bpe: a "
                            "byte-level BPE with Hugging Face tokenizers, OUTPUT.tokenizer.json "
                            "and OUTPUT.tokenizer.meta.json (pip install 'megabeta[hf]')")
    train.add_argument("--model-type", choices=MODEL_TYPES,
                       default=TokenizerTrainingConfig.model_type,
                       help="sentencepiece algorithm (--kind sentencepiece)")
    train.add_argument("--max-sentences", type=int, metavar="N",
                       default=TokenizerTrainingConfig.max_sentences,
                       help="lines sampled for training at most (bounds memory)")
    train.add_argument("--seed", type=int, default=TokenizerTrainingConfig.seed,
                       help="seed of the line sample")
    train.add_argument("--character-coverage", type=float, metavar="F",
                       default=TokenizerTrainingConfig.character_coverage,
                       help="share of characters given pieces; rarer ones fall back to bytes")
    train.add_argument("--num-threads", type=int, metavar="N",
                       default=TokenizerTrainingConfig.num_threads,
                       help="sentencepiece training threads; the model depends on this number, "
                            "keep it fixed to reproduce a model")
    _add_read_arguments(train)
    _add_output_arguments(train)
    train.set_defaults(run=_run_train_tokenizer)

    tok = commands.add_parser(
        "tokenize", formatter_class=_Formatter,
        help="tokenize a corpus into PREFIX.bin, .idx, .json",
        description="Stream the inputs, encode them with --workers processes, append EOS after "
                    "each document (no BOS) and write a Megatron-compatible indexed dataset "
                    "(uint16 tokens when the vocabulary fits, int32 otherwise) plus a JSON "
                    "sidecar, and with --segments-key a per-token loss mask. Under mpirun/srun "
                    "each rank tokenizes a contiguous share of the input files into a part next "
                    "to the output, and rank 0 merges the parts. "
                    "The output is byte-identical for any number of workers or ranks.")
    tok.add_argument("--tokenizer", required=True, metavar="FILE",
                     help="sentencepiece .model, or Hugging Face tokenizer.json (any *.json; "
                          "pip install 'megabeta[hf]'), e.g. from train-tokenizer")
    tok.add_argument("--inputs", nargs="+", required=True, metavar="PATH",
                     help=f"corpus files, directories or globs: {ACCEPTED} (.zst needs "
                          "'megabeta[zstd]', .parquet 'megabeta[parquet]')")
    tok.add_argument("--output-prefix", required=True, metavar="PREFIX",
                     help="writes PREFIX.bin, PREFIX.idx and PREFIX.json")
    tok.add_argument("--workers", type=int, default=TokenizeConfig.workers, metavar="N",
                     help="sentencepiece: encoding processes per rank, the reading process "
                          "included (it encodes whenever the others are busy; default 1). "
                          "tokenizer.json: the tokenizers library's threads (default: every "
                          "core), no processes")
    tok.add_argument("--chunk-mb", type=float, default=TokenizeConfig.chunk_bytes / 1e6,
                     metavar="MB", help="input megabytes per unit of work sent to a worker")
    tok.add_argument("--mpi", choices=MPI_MODES, default=TokenizeConfig.mpi,
                     help="auto: use MPI when launched by mpirun/srun; on: require it; off: "
                          "never (MPI needs pip install 'megabeta[mpi]')")
    _add_read_arguments(tok)
    tok.add_argument("--segments-key", metavar="KEY", default=ReadOptions.segments_key,
                     help="JSONL field holding each document as a list of {\"text\": str, "
                          "\"loss\": bool} segments, in order; also writes PREFIX.mask, which "
                          "marks the tokens of the segments with loss true as the scored "
                          "targets (each segment is encoded on its own; the EOS is not scored). "
                          "Off: the text of --text-key, every target scored")
    tok.add_argument("--keep-empty", action="store_true",
                     help="write an empty document as a document of no tokens (as Megatron "
                          "does), so document indices follow the input's records; default: "
                          "skip it with a warning")
    _add_output_arguments(tok)
    tok.set_defaults(run=_run_tokenize)

    mrg = commands.add_parser(
        "merge", formatter_class=_Formatter, help="concatenate datasets into one",
        description="Concatenate datasets made separately, in the order given. They must hold "
                    "the same token type and, where they have sidecars, come from the same "
                    "tokenizer model. If any has a loss mask, so does the output (every target "
                    "of the others scored).")
    mrg.add_argument("--inputs", nargs="+", required=True, metavar="PREFIX",
                     help="dataset prefixes (without .bin/.idx)")
    mrg.add_argument("--output-prefix", required=True, metavar="PREFIX",
                     help="writes PREFIX.bin, PREFIX.idx and PREFIX.json")
    _add_output_arguments(mrg)
    mrg.set_defaults(run=_run_merge)

    ins = commands.add_parser(
        "inspect", formatter_class=_Formatter,
        help="counts, histogram, samples and checks; or a run's training samples",
        description="Print counts, a histogram of document lengths and decoded samples, and "
                    "check that index and .bin agree, every id is below the vocabulary size, the "
                    "sidecar matches, documents end with EOS and the loss mask (if any) "
                    "matches its sidecar entry. Exit status 2 if a check fails. With --run "
                    "instead of PREFIX: decode the training samples a run read at --step, "
                    "--position or --sample (as a spike warning names them), its data rebuilt "
                    "from the run's config.toml as the trainer built it.")
    ins.add_argument("prefix", metavar="PREFIX", nargs="?",
                     help="dataset prefix (without .bin/.idx); leave out with --run")
    ins.add_argument("--tokenizer", metavar="MODEL", default=InspectConfig.tokenizer,
                     help="model for decoding and the hash check (default: the sidecar's, when "
                          "the file is present and matches; with --run the run's)")
    ins.add_argument("--samples", type=int, default=InspectConfig.samples, metavar="N",
                     help="documents to decode, spread over the dataset")
    ins.add_argument("--sample-tokens", type=int, default=InspectConfig.sample_tokens,
                     metavar="N", help="tokens shown per decoded document (--run shows whole "
                                       "samples)")
    run = ins.add_argument_group("a run's training samples")
    run.add_argument("--run", metavar="RUN_DIR", dest="run_dir",
                     help="a training run's directory (its config.toml names the data, blend, "
                          "split, seq_len, align and seed)")
    where = run.add_mutually_exclusive_group()
    where.add_argument("--step", type=int, metavar="N",
                       help="every sample of optimizer step N (train.global_batch of them)")
    where.add_argument("--position", type=int, metavar="P",
                       help="the sample at position P of the run's global sample stream (a "
                            "spike warning's `stream positions`)")
    where.add_argument("--sample", type=int, metavar="I",
                       help="index I of the training split (a spike warning's `dataset "
                            "samples`)")
    ins.set_defaults(run=_run_inspect, parser=ins)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except FailedElsewhere:
        return 2
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing was written under the output names", file=sys.stderr)
        return 130
