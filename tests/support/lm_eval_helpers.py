"""Task definitions of the project's own for lm-evaluation-harness tests: YAML over local JSONL
files (the harness's `dataset_path: json`), one per request type, so that no test needs the
network: multiple choice (loglikelihood), rolling perplexity (loglikelihood_rolling) and
generation with a stop sequence (generate_until)."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ("alpha beta gamma delta epsilon model token layer block depth train value return "
         "import class self print while for if else data loader sample").split()

TASKS = ("mb_choice", "mb_rolling", "mb_generate")


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _yaml(path: Path, task: str, data: Path, body: str) -> None:
    path.write_text(f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                    f"    test: {data}\ntest_split: test\n{body}", encoding="utf-8")


def write_tasks(directory: Path, documents: int = 6) -> Path:
    """The three tasks' YAML and JSONL files under `directory` (returned: the include path)."""
    directory.mkdir(parents=True, exist_ok=True)
    choice = [{"question": " ".join(WORDS[i:i + 4]), "choices": [f" {WORDS[(i + k) % 24]}"
                                                                 for k in range(4, 8)],
               "label": i % 4} for i in range(documents)]
    rolling = [{"text": " ".join(WORDS[(i * 5 + k) % 24] for k in range(6 + 9 * i))}
               for i in range(documents)]
    generate = [{"question": f"{WORDS[i]} {WORDS[i + 1]} =", "answer": f" {WORDS[i + 2]}"}
                for i in range(documents)]
    _yaml(directory / "mb_choice.yaml", "mb_choice", _jsonl(directory / "choice.jsonl", choice),
          "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
          "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
          "metric_list:\n  - metric: acc\n  - metric: acc_norm\nmetadata:\n  version: 1.0\n")
    _yaml(directory / "mb_rolling.yaml", "mb_rolling",
          _jsonl(directory / "rolling.jsonl", rolling),
          "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
          "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
          "  - metric: bits_per_byte\nmetadata:\n  version: 1.0\n")
    _yaml(directory / "mb_generate.yaml", "mb_generate",
          _jsonl(directory / "generate.jsonl", generate),
          "output_type: generate_until\ndoc_to_text: \"{{question}}\"\n"
          "doc_to_target: \"{{answer}}\"\n"
          "generation_kwargs:\n  until: [\"\\n\", \" model\"]\n  max_gen_toks: 6\n"
          "  do_sample: false\n"
          "metric_list:\n  - metric: exact_match\nmetadata:\n  version: 1.0\n")
    return directory
