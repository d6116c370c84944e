"""Under torchrun: `megabeta train` (a config file, then overrides) with rank 1's data loading
slowed down: SLOW seconds per batch before step HANG (a straggler), then STALL seconds once at
step HANG (a hang the watchdog must report)."""

from __future__ import annotations

import sys
import time

from megabeta.config import load_config
from megabeta.train.loop import Trainer

SLOW, HANG, STALL = 0.15, 4, 6.0


class SlowBatches:
    """The loader, with rank 1's batches delayed; everything else delegated."""

    def __init__(self, loader, trainer: Trainer) -> None:
        self.loader, self.trainer = loader, trainer

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        stalled = False
        for batch in self.loader:
            step = self.trainer.state.step + 1
            if step < HANG:
                time.sleep(SLOW)
            elif step == HANG and not stalled:
                stalled = True
                time.sleep(STALL)
            yield batch


def main() -> None:
    trainer = Trainer(load_config(sys.argv[1], sys.argv[2:]))
    if trainer.env.rank == 1:
        trainer.loader = SlowBatches(trainer.loader, trainer)
    trainer.train()


if __name__ == "__main__":
    main()
