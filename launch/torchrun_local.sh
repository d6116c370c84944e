#!/usr/bin/env bash
# Train on this machine with NPROC processes (default 2), e.g.
#   NPROC=8 launch/torchrun_local.sh --config configs/t19_flash.toml --data.path=data/corpus \
#       --optim.lr=3e-4
# --standalone runs its own rendezvous on a free local port, so concurrent runs do not collide.
set -euo pipefail
exec torchrun --standalone --nproc_per_node="${NPROC:-2}" -m megabeta.train "$@"
