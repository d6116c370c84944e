"""Synthetic tasks with scored answers, for measuring serial depth with the normal pipeline.

`megabeta tasks make` writes a task file (JSONL of segmented documents, answers marked:
`document`), from a seeded generator per task (`chains`, `permutations`, `parity`; the registry
in `make`); `megabeta-data tokenize --segments-key segments` turns it into a masked training set;
`megabeta tasks eval` (`cli`) reports a model's exact-match accuracy on a task file
(`evaluate`: tokenizing as training does; `scoring`: the pure scoring of (tokens, mask)
documents against any next-token predictor). Each task's module documents its text format and
how its chance level is defined.
"""
