"""`megabeta bench kernels`: every Triton kernel compiled for an NVIDIA target without a GPU.

The command runs in a subprocess without `TRITON_INTERPRET` (this suite's conftest sets it, and
the interpreter's kernels do not compile). What it must find: every kernel of every variant
compiles; no kernel of a 16-bit variant spills (the split-K partial sums are float32 there too);
a float32 variant's kernels spill under 1.25 KiB a thread (stores, and loads). The document-masked
attention kernels (spec §7) are compiled for a representative subset of the variants here
(`--masked subset`: both head widths, float32 and bfloat16, both schedules), all of them by the
command's default.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO

pytest.importorskip("triton")

OLDEST_TRITON = REPO / ".venv" / "triton-3.6"
"""Triton 3.6.0, the oldest the project supports, installed apart by `make test`
(`pip install --target`): the bench runs against it with this folder first on PYTHONPATH."""


def _compile_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return {**env, **extra}


def _run(args: list[str], env: dict[str, str], tmp_path: Path) -> tuple[str, list[dict]]:
    out = tmp_path / "builds.json"
    proc = subprocess.run([sys.executable, "-m", "megabeta.bench", "kernels", *args,
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def _check_findings(stdout: str, builds: list[dict], arch: int) -> None:
    last = stdout.strip().splitlines()[-1]
    match = re.fullmatch(rf"kernels: (\d+) compiled for sm_{arch}; 0 errors; (\d+) spilling "
                         rf"\(largest spill (\d+) bytes\)", last)
    assert match, last
    assert int(match.group(1)) == len(builds) and all(b["error"] is None for b in builds)
    assert {b["kernel"] for b in builds} == {
        "_forward_kernel", "_merge_kernel", "_backward_kernel", "_reduce_kernel",
        "_history_kernel", "_history_reduce_kernel", "_rms_forward_kernel",
        "_rms_backward_kernel", "_split_rope_forward_kernel", "_split_rope_backward_kernel",
        "_swiglu_forward_kernel", "_swiglu_backward_kernel"}
    attention = [b for b in builds if b["kernel"] in ("_forward_kernel", "_backward_kernel")]
    # The variants reached: every dtype and both head widths, with and without the self slot,
    # both schedules.
    reached = {(b["kernel"], b["params"].split()[0], re.search(r"D=(\d+)", b["params"])[1],
                "HAS_SELF=True" in b["params"]) for b in attention}
    for kernel in ("_forward_kernel", "_backward_kernel"):
        for dtype in ("float32", "bfloat16", "float16"):
            for width in ("64", "200"):
                assert (kernel, dtype, width, True) in reached, (kernel, dtype, width)
        assert (kernel, "bfloat16", "200", False) in reached
    masked = {(b["kernel"], b["params"].split()[0], re.search(r"D=(\d+)", b["params"])[1])
              for b in attention if "HAS_DOCS=True" in b["params"]}
    assert masked == {(kernel, dtype, width) for kernel in ("_forward_kernel", "_backward_kernel")
                      for dtype in ("float32", "bfloat16") for width in ("64", "200")}, masked
    labels = {v for b in builds for v in b["variants"]}
    assert any("wavefront" in v for v in labels) and any("num_kv_heads" in v for v in labels)
    spills = {(b["kernel"], b["params"], tuple(b["variants"])): max(b["spill_stores"],
                                                                     b["spill_loads"])
              for b in builds}
    # The training precisions (bf16, fp16 and their float32 partial sums) never spill; float32
    # models (the exactness path: IEEE products on CUDA cores) spill little.
    assert not [k for k, s in spills.items()
                if s and not all(v.split()[1] == "float32" for v in k[2])], spills
    assert max(spills.values()) < 1280
    assert all(b["registers"] <= 255 and b["shared"] <= 232448 for b in builds)
    # Tensor cores where the dtype has them: wgmma on sm_90 at head width 64.
    assert any(b["mma"] == "wgmma" for b in attention if "D=64" in b["params"]
               and b["params"].startswith("bfloat16"))


def test_every_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    stdout, builds = _run(["--arch", "90", "--jobs", "2", "--masked", "subset"], _compile_env(),
                          tmp_path)
    _check_findings(stdout, builds, 90)


def test_kernels_compile_with_the_oldest_supported_triton(tmp_path: Path) -> None:
    if not OLDEST_TRITON.is_dir():
        # CI sets MEGABETA_REQUIRE_OLDEST_TRITON: there a missing install fails, not skips.
        message = f"triton 3.6 is not installed at {OLDEST_TRITON} (make test installs it)"
        if os.environ.get("MEGABETA_REQUIRE_OLDEST_TRITON") == "1":
            pytest.fail(message)
        pytest.skip(message)
    env = _compile_env(PYTHONPATH=os.pathsep.join(
        [str(OLDEST_TRITON), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    stdout, builds = _run(["--arch", "90", "--jobs", "2", "--masked", "subset"], env, tmp_path)
    assert "triton 3.6.0" in stdout.splitlines()[0]
    _check_findings(stdout, builds, 90)


def test_compile_errors_and_limits_are_findings(tmp_path: Path) -> None:
    """A kernel that runs under the interpreter but does not compile is a row with its error,
    not an exception; a resource over the target's limits is an error too."""
    code = r'''
import triton, triton.language as tl, torch
from megabeta.kernels.compile_target import CompileForTarget, KernelBuild
from megabeta.kernels.ops import launch

@triton.jit
def mismatched(X, flag, N: tl.constexpr):  # flag: not 1, which Triton would specialise
    offs = tl.arange(0, N)
    if flag > 0:
        v = tl.load(X + offs).to(tl.float32)
    else:
        v = tl.load(X + offs)
    tl.store(X + offs, v.to(X.dtype.element_ty))

x = torch.zeros(16, dtype=torch.bfloat16)
with CompileForTarget(90) as target:
    target.variant = "bad"
    launch(mismatched, (1,), x, 3, N=16)
    launch(mismatched, (1,), x, 3, N=16)
    target.variant = "good"
    launch(mismatched, (1,), x.float(), 3, N=16)
bad, good = target.builds
assert bad.error and "Mismatched type" in bad.error and bad.variants == ["bad"], bad
assert good.error is None and good.registers > 0 and good.mma == "none", good
assert good.limit_error() is None
over = KernelBuild("k", 80, "key", "", registers=10, shared=200_000)
assert "shared memory" in over.limit_error()
print("ok")
'''
    script = tmp_path / "probe.py"  # Triton reads a kernel's source from its file
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=_compile_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_bad_flags_name_the_flag() -> None:
    for args, needle in ((["--arch", "75"], "--arch"), (["--only", "no-such"], "--only"),
                         (["--jobs", "0"], "--jobs")):
        proc = subprocess.run([sys.executable, "-m", "megabeta.bench", "kernels", *args],
                              cwd=REPO, env=_compile_env(), capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr, (args, proc.stderr)
    proc = subprocess.run([sys.executable, "-m", "megabeta.bench", "kernels"], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stderr
