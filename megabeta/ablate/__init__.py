"""`megabeta ablate`: train model arms through the real trainer on the same data, compare them.

    suites   the scale table (tiny / small / article), arms from preset names or config files,
             scaled and, where a suite compares at equal parameters, resolved to the reference's
             count (`resolve_fair_config`); the built-in suites c-sweep, depth and state
    runner   one arm-seed run: `python -m megabeta.train --resume=auto` into OUT/runs/ARM-seedS,
             then its evaluation on the held-out split (and the task accuracy), written atomically
             to result.json, so a killed ablation skips finished runs and resumes the others;
             the state suite's task data (generated, tokenizer trained, tokenized) when not given
    summary  mean ± standard deviation over seeds, deltas against the reference arm; Markdown,
             CSV and JSON
    plot     summary.png: loss curves per arm (mean over seeds, min-max band), task accuracies
    cli      `megabeta ablate --help`
"""
