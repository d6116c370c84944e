"""summary.md's caption (megabeta/ablate/summary.py): the test loss is described as what it was
measured on (the header's `test loss`), not as "the answers" whenever there are task
accuracies: with --task-files on a corpus the test loss is the validation split's every token."""

from __future__ import annotations

from megabeta.ablate.summary import markdown, summarize


def test_the_caption_says_what_the_test_loss_was_measured_on() -> None:
    result = {"arm": "standard", "seed": 1, "parameters": 1000,
              "test": {"loss": 2.0, "ppl": 7.4}, "accuracy": 0.3,
              "tasks": {"parity-L8": {"accuracy": 0.3, "chance": 0.5}},
              "train": {"s_per_batch": 0.5, "tokens_per_s": 128.0, "final_loss": 2.1}}
    rows = summarize([result], ["standard"], reference="standard")
    on = ("mean over the scored targets of the validation split (val_fraction 0.05) of --data: "
          "every token (no loss mask)")
    text = markdown(rows, {"suite": "custom arms", "test loss": on})
    assert f"Test loss: {on}; accuracy: exact match per answer of the task files" in text
    assert "the answers" not in text
