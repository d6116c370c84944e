"""Run `megabeta train ARGS` with os.fsync and os.replace recorded: `record_fsync.py OUT -- ARGS`.

Each process appends its events to OUT/events_<pid>.jsonl: {"op": "fsync", "ino": inode,
"path": the file's path then, "t": monotonic ns} and {"op": "replace", "src", "dst", "t"}.
CLOCK_MONOTONIC is one clock for every process of the machine, so ranks' events can be ordered."""

import json
import os
import sys
import time

out, args = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
log = open(os.path.join(out, f"events_{os.getpid()}.jsonl"), "a", buffering=1)
real_fsync, real_replace = os.fsync, os.replace


def fsync(fd):
    real_fsync(fd)
    log.write(json.dumps({"op": "fsync", "ino": os.fstat(fd).st_ino,
                          "path": os.readlink(f"/proc/self/fd/{fd}"),
                          "t": time.monotonic_ns()}) + "\n")


def replace(src, dst, **kwargs):
    real_replace(src, dst, **kwargs)
    log.write(json.dumps({"op": "replace", "src": os.fspath(src), "dst": os.fspath(dst),
                          "t": time.monotonic_ns()}) + "\n")


os.fsync, os.replace = fsync, replace
from megabeta.train.cli import main  # noqa: E402 - after the patch, as the trainer would see it

sys.exit(main(args))
