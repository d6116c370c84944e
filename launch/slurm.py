#!/usr/bin/env python3
"""Write an sbatch script that runs megabeta's trainer on every node of a SLURM job: torchrun on
each node (one srun task per node), or one srun task per rank (`--launcher srun`).

Everything cluster-specific (partition, account, modules, NCCL variables) comes from flags, so the
same generator serves any cluster; nothing is hard-coded. See launch/README.md and `--help`.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

from megabeta.storage.durable import AtomicFiles

TRAIN_MODULE = "megabeta.train"
LAUNCHERS = ("torchrun", "srun")
# Same rule as megabeta.parallel.env.slurm_port: unprivileged, below the ephemeral range, and
# different for two jobs sharing a node.
PORT_FROM_JOB_ID = "$((20000 + SLURM_JOB_ID % 10000))"

EXAMPLE = """\
example:
  python launch/slurm.py --nodes 4 --gpus-per-node 8 --cpus-per-task 64 --partition gpu \\
      --time 1-00:00:00 --requeue --signal-seconds 300 --venv .venv --write train.sbatch \\
      -- --config configs/t19_flash.toml --data.path=/data/corpus --optim.lr=3e-4
  sbatch train.sbatch

Every node runs one srun task: torchrun, which starts --nproc-per-node workers there and meets the
other nodes' torchruns at the first node's address (its NodeAddr from `scontrol show node`, since
node names need not resolve everywhere; the batch host's name if scontrol cannot tell).

With --launcher srun there is no torchrun: srun starts --nproc-per-node tasks per node, each a
training rank that finds its rank from SLURM's variables and meets the others at the same address.

Preemption: --signal-seconds N makes SLURM send SIGUSR1 to every process of the step N seconds
before the time limit (torchrun itself is made to ignore it; the trainer stops at the next step
boundary and saves). --requeue makes the job requeueable and, for megabeta.train, adds
--checkpoint.requeue=true (after saving on a stop signal the trainer runs `scontrol requeue`) and
--resume=auto (the rerun resumes from the newest checkpoint) unless the arguments set them.
"""


def build_parser() -> argparse.ArgumentParser:
    """The command line; every flag's help says what it becomes in the script."""
    p = argparse.ArgumentParser(
        prog="launch/slurm.py",
        description="Generate an sbatch script running `python -m megabeta.train ARGS` with\n"
                    "torchrun on every node. Training arguments go after `--`.",
        usage="%(prog)s --gpus-per-node G [options] -- --config CONFIG [overrides ...]",
        epilog=EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    job = p.add_argument_group("allocation (#SBATCH lines)")
    job.add_argument("--nodes", type=int, default=1, metavar="N",
                     help="nodes to allocate (default 1)")
    job.add_argument("--gpus-per-node", type=int, required=True, metavar="G",
                     help="GPUs to request per node (#SBATCH --gpus-per-node); 0 for a CPU-only "
                          "job")
    job.add_argument("--cpus-per-task", type=int, metavar="C",
                     help="CPUs per srun task: with torchrun the node's task, i.e. torchrun and "
                          "all its workers on that node; with --launcher srun one rank; also "
                          "passed to srun, which no longer inherits it (default: unset)")
    job.add_argument("--partition", help="partition to submit to (default: the cluster's default)")
    job.add_argument("--account", help="account to charge (default: your default account)")
    job.add_argument("--time", help="time limit: MIN, MIN:SEC, H:MIN:SEC, D-H, D-H:MIN or "
                                    "D-H:MIN:SEC (default: the partition's)")
    job.add_argument("--job-name", default="megabeta", help="job name (default megabeta)")
    job.add_argument("--output", default="%x-%j.out",
                     help="log file pattern; %%x is the job name, %%j the job id "
                          "(default %%x-%%j.out)")
    job.add_argument("--requeue", action="store_true",
                     help="make the job requeueable (#SBATCH --requeue) and have the trainer "
                          "requeue it after saving on a stop signal and resume when it reruns "
                          "(adds --checkpoint.requeue=true --resume=auto for megabeta.train "
                          "unless the training arguments set them)")
    job.add_argument("--signal-seconds", type=int, metavar="N",
                     help="send SIGUSR1 to the job's processes N seconds before the time limit "
                          "(#SBATCH --signal=USR1@N) so the trainer saves and stops in time; "
                          "SLURM may deliver it up to a minute late, so leave a margin")
    job.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                     help="extra #SBATCH option, repeatable, e.g. --sbatch=--qos=high "
                          "--sbatch=--constraint=h100")
    run = p.add_argument_group("run")
    run.add_argument("--launcher", choices=LAUNCHERS, default="torchrun",
                     help="torchrun: one srun task per node runs torchrun, which starts that "
                          "node's ranks; srun: one srun task per rank, no torchrun (default "
                          "torchrun)")
    run.add_argument("--nproc-per-node", type=int, metavar="P",
                     help="training processes per node (default: --gpus-per-node, or 1 for 0 GPUs)")
    run.add_argument("--module", default=TRAIN_MODULE,
                     help=f"Python module torchrun runs with `-m` (default {TRAIN_MODULE}); the "
                          "arguments after `--` are its arguments")
    run.add_argument("--port", type=int,
                     help="rendezvous port on the first node (default: 20000 + job id %% 10000, so "
                          "jobs sharing a node do not collide)")
    run.add_argument("--venv", metavar="DIR",
                     help="virtual environment to activate in the job (made absolute)")
    run.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                     help="variable to export in the job, repeatable, e.g. --env NCCL_IB_HCA=mlx5")
    run.add_argument("--write", metavar="FILE",
                     help="write the script to FILE (executable, replaced atomically) instead "
                          "of stdout")
    return p


def time_limit_seconds(text: str) -> int | None:
    """Seconds in a SLURM time limit, None for an unlimited one; ValueError for anything else."""
    if text.lower() in ("unlimited", "infinite"):
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if m is None:
        raise ValueError("expected MIN, MIN:SEC, H:MIN:SEC, D-H, D-H:MIN or D-H:MIN:SEC")
    days, a, b, c = (None if g is None else int(g) for g in m.groups())
    if days is not None:
        return days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if b is None:
        return a * 60
    if c is None:
        return a * 60 + b
    return a * 3600 + b * 60 + c


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flags that would give a script sbatch rejects or a job that cannot work."""
    for flag, value, low in (("--nodes", args.nodes, 1), ("--gpus-per-node", args.gpus_per_node, 0),
                             ("--cpus-per-task", args.cpus_per_task, 1),
                             ("--nproc-per-node", args.nproc_per_node, 1),
                             ("--signal-seconds", args.signal_seconds, 1),
                             ("--port", args.port, 1)):
        if value is not None and value < low:
            p.error(f"{flag} must be >= {low}, got {value}")
    if args.port is not None and args.port > 65535:
        p.error(f"--port must be <= 65535, got {args.port}")
    for flag in ("partition", "account", "time", "job_name", "output"):
        value = getattr(args, flag)
        if value is not None and (not value or re.search(r"\s", value)):
            p.error(f"--{flag.replace('_', '-')} {value!r}: must be non-empty without blanks "
                    "(it goes on an #SBATCH line)")
    if re.fullmatch(r"[A-Za-z_][\w.]*", args.module) is None:
        p.error(f"--module {args.module!r}: expected a dotted Python module name")
    for option in args.sbatch:
        if not option.startswith("-") or re.search(r"\s", option):
            p.error(f"--sbatch {option!r}: give one option without blanks, "
                    "e.g. --sbatch=--qos=high")
    for item in args.env:
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", item) is None:
            p.error(f"--env {item!r}: expected NAME=VALUE with NAME a shell variable name")
    if args.time is not None:
        try:
            limit = time_limit_seconds(args.time)
        except ValueError as err:
            p.error(f"--time {args.time!r}: {err}")
        if args.signal_seconds is not None and limit is not None and args.signal_seconds >= limit:
            p.error(f"--signal-seconds {args.signal_seconds} is not before the end of --time "
                    f"{args.time} ({limit} s): the signal would never come")
    if not args.train_args:
        p.error("no training arguments: put them after `--`, e.g. "
                "-- --config configs/t19_flash.toml --data.path=PREFIX")


def trainer_args(args: argparse.Namespace) -> list[str]:
    """The module's arguments: the user's, then what --requeue needs of megabeta.train (a
    requeued job that neither requeues nor resumes would simply end, or start over)."""
    extra = []
    if args.requeue and args.module == TRAIN_MODULE:
        given = {a.split("=", 1)[0] for a in args.train_args}
        extra += [flag for flag in ("--checkpoint.requeue=true", "--resume=auto")
                  if flag.split("=", 1)[0] not in given]
    return [*args.train_args, *extra]


def render(args: argparse.Namespace, argv: list[str]) -> str:
    """The sbatch script for parsed, checked flags; `argv` is recorded so it can be regenerated."""
    nproc = args.nproc_per_node or max(args.gpus_per_node, 1)
    per_node = nproc if args.launcher == "srun" else 1
    sbatch = [f"--job-name={args.job_name}", f"--nodes={args.nodes}",
              f"--ntasks-per-node={per_node}"]
    if args.gpus_per_node:
        sbatch.append(f"--gpus-per-node={args.gpus_per_node}")
    for flag in ("cpus_per_task", "partition", "account", "time", "output"):
        if getattr(args, flag) is not None:
            sbatch.append(f"--{flag.replace('_', '-')}={getattr(args, flag)}")
    if args.requeue:
        sbatch.append("--requeue")
    if args.signal_seconds is not None:
        sbatch.append(f"--signal=USR1@{args.signal_seconds}")
    sbatch.extend(args.sbatch)

    lines = ["#!/bin/bash",
             "# Generated by launch/slurm.py; regenerate rather than edit. Submit: sbatch FILE",
             f"# python launch/slurm.py {shlex.join(argv)}"]
    lines += [f"#SBATCH {option}" for option in sbatch]
    lines += ["", "set -eo pipefail"]
    if args.venv:
        lines.append(f"source {shlex.quote(str(Path(args.venv).absolute() / 'bin' / 'activate'))}")
    for item in args.env:
        name, value = item.split("=", 1)
        lines.append(f"export {name}={shlex.quote(value)}")
    srun = ["srun", '--nodes="$SLURM_NNODES"', f"--ntasks-per-node={per_node}",
            "--kill-on-bad-exit=1"]
    if args.cpus_per_task is not None:
        srun.append(f"--cpus-per-task={args.cpus_per_task}")
    train = ["-m", args.module, *map(shlex.quote, trainer_args(args))]
    lines += [
        "",
        "# Rank 0 runs on the first node. Node names need not resolve on every node (several",
        "# slurmd per host, private naming), its NodeAddr does; the batch shell runs on that node,",
        "# so its hostname is the fallback when scontrol cannot tell.",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null \\',
        "    | head -n 1 || true)",
        'HEAD_ADDR=""',
        'if [ -n "$HEAD_NODE" ]; then',
        '    HEAD_ADDR=$(scontrol show node "$HEAD_NODE" 2>/dev/null \\',
        "        | grep -o 'NodeAddr=[^ ]*' | head -n 1 | cut -d= -f2 || true)",
        "fi",
        'HEAD_ADDR=${HEAD_ADDR:-${HEAD_NODE:-$(hostname)}}',
        f"RDZV_PORT={args.port if args.port is not None else PORT_FROM_JOB_ID}",
        'echo "megabeta: job $SLURM_JOB_ID on $SLURM_NNODES node(s), rendezvous at" \\',
        '    "$HEAD_ADDR:$RDZV_PORT"',
        "",
    ]
    if args.launcher == "srun":
        lines += [
            "# One srun task per rank; each reads its rank from SLURM's variables and meets the",
            "# others at MASTER_ADDR:MASTER_PORT (megabeta.parallel.env.discover).",
            'export MASTER_ADDR="$HEAD_ADDR" MASTER_PORT="$RDZV_PORT"',
            " ".join(srun) + " \\",
            "    python3 " + " ".join(train),
            "",
        ]
        return "\n".join(lines)
    torchrun = ["torchrun", '--nnodes="$SLURM_NNODES"', f"--nproc_per_node={nproc}",
                "--rdzv_backend=c10d", '--rdzv_endpoint="$HEAD_ADDR:$RDZV_PORT"',
                '--rdzv_id="$SLURM_JOB_ID"']
    lines += [
        "# One task per node runs torchrun, which starts that node's workers. SIGUSR1 reaches",
        "# every process of the step; its default action would kill torchrun (and the step with",
        "# it), so torchrun ignores it while the workers install their own handler.",
        " ".join(srun) + " \\",
        "    bash -c 'trap \"\" USR1; exec \"$@\"' torchrun \\",
        "    " + " ".join(torchrun[:4]) + " \\",
        "        " + " ".join(torchrun[4:]) + " \\",
        "    " + " ".join(train),
        "",
    ]
    return "\n".join(lines)


def generate(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """Parse `argv` (flags, then `--` and the training arguments) into the script text."""
    p = build_parser()
    split = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:split])
    args.train_args = argv[split + 1:]
    bad = [a for a in argv if "\n" in a or "\r" in a]
    if bad:
        p.error(f"argument {bad[0]!r} contains a line break")
    _check(p, args)
    if args.venv and not (Path(args.venv) / "bin" / "activate").is_file():
        print(f"warning: --venv {args.venv}: no bin/activate here; the job will fail unless it "
              "exists on the cluster's nodes", file=sys.stderr)
    return render(args, argv), args


def main(argv: list[str] | None = None) -> int:
    """Entry point: print the script, or write it with --write."""
    argv = sys.argv[1:] if argv is None else argv
    script, args = generate(argv)
    if args.write:
        path = Path(args.write)
        if not path.parent.is_dir():
            build_parser().error(f"--write {args.write}: directory {path.parent} does not exist")
        with AtomicFiles([path]) as files:
            files.temp(path).write_text(script)
            files.temp(path).chmod(0o755)  # executable before it appears under its name
            files.commit()
        print(f"wrote {path}; submit with: sbatch {shlex.quote(str(path))}", file=sys.stderr)
    else:
        sys.stdout.write(script)
    return 0


if __name__ == "__main__":
    sys.exit(main())
