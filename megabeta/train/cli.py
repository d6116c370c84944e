"""`megabeta train --config configs/NAME.toml [--section.key=value ...]` (or python -m megabeta.train).

Works unchanged under torchrun, srun and mpirun: ranks are discovered from the launcher's
environment (megabeta.parallel.env).
"""

from __future__ import annotations

import argparse
import sys

from megabeta.checkpoint import CheckpointError
from megabeta.checkpoint.export import initial_model_config
from megabeta.config import describe_fields, load_config
from megabeta.data import DataError
from megabeta.model import ConfigError

EPILOG = """overrides:
  --SECTION.KEY=VALUE   any config field, e.g. --optim.lr=3e-4 --train.steps=1000
                        (how the model runs: --execution.attention=auto|reference|
                        cpu|triton,
                        --execution.schedule=block|wavefront,
                        --execution.activation_checkpoint=none|block|wave)
  --run_dir=DIR         where config, metrics.jsonl, tb/ and checkpoints/ go
  --resume=auto|PATH    continue from the newest checkpoint in run_dir, or from PATH
  --data.path=A,B --data.weights=0.7,0.3   blend several datasets
  --model.init_from=DIR start from the weights (and shape) of a model: a folder of
                        `megabeta export --format hf` (e.g. from the Hub), an export or a
                        checkpoint directory; a fresh optimizer and step 0

`megabeta train --help-config` lists every field with its default and meaning.
examples:
  megabeta train --config configs/tiny_cpu.toml --data.path=data/corpus --run_dir=runs/t1
  torchrun --nproc_per_node=8 -m megabeta.train --config configs/t19_flash.toml --resume=auto
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megabeta train", description=__doc__,
                                     epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TOML file with the run configuration, or the name of a "
                        "shipped one (configs/: tiny_cpu, demo, t19_flash, beta_1.2_test, ...)")
    parser.add_argument("--help-config", action="store_true",
                        help="print every config key with its default and meaning, then exit")
    args, overrides = parser.parse_known_args(argv)
    if args.help_config:
        print(describe_fields())
        return 0
    from megabeta.parallel.env import destroy_distributed
    from megabeta.train.loop import TrainingStopped, run

    try:
        config = load_config(args.config, overrides, read_model=initial_model_config)
        result = run(config)
    except (ConfigError, DataError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except TrainingStopped as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    if not result.get("preempted"):
        # A finished run's group goes before the interpreter's teardown, where gloo's threads
        # torn down at exit could abort a rank whose work is done ("terminate called without
        # an active exception") and fail the job. A preempted run's processes are the
        # scheduler's to end (a requeue signals them at once).
        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
