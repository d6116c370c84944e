"""The CPU attention kernels' builds (megabeta/kernels/cpu_attention.py): one per instruction
set, chosen by torch's CPU capability, each exact against the float64 reference.

The exactness matrix (test_history_attention.py) runs the build this machine picks; here the
same rows run again under the lower instruction set, in a process whose torch is held to it
(`ATEN_CPU_CAPABILITY`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megabeta.kernels import cpu_attention

ROOT = Path(__file__).resolve().parents[3]


def _in_process_held_to(capability: str, *command: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    return subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


def test_each_instruction_set_builds_its_own_library() -> None:
    avx2, avx512 = cpu_attention.flags("AVX2"), cpu_attention.flags("AVX512")
    assert "-DCPU_CAPABILITY=AVX2" in avx2 and "-mavx512f" not in avx2
    assert "-DCPU_CAPABILITY=AVX512" in avx512 and "-mavx512f" in avx512
    assert cpu_attention.build_name("AVX2") != cpu_attention.build_name("AVX512")


@pytest.mark.skipif(cpu_attention.isa() != "AVX512",
                    reason="needs a CPU with AVX-512 (the AVX2 build is the one the matrix runs)")
def test_the_avx2_build_matches_the_reference_on_an_avx512_machine() -> None:
    probe = _in_process_held_to("avx2", "-c", "from megabeta.kernels import cpu_attention as c; "
                                "print(c.isa(), c.build(), c.build_name())")
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split()[-3:] == ["AVX2", "True", cpu_attention.build_name("AVX2")]
    matrix = ["-m", "pytest", "-p", "no:cacheprovider",
              "tests/unit/kernels/test_history_attention.py", "-k", "cpu-float"]
    rows = _in_process_held_to("avx2", *matrix)
    assert rows.returncode == 0, rows.stdout[-4000:] + rows.stderr[-2000:]
    listed = subprocess.run([sys.executable, *matrix, "--collect-only"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    passed = re.search(r"(\d+) passed", rows.stdout)
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", listed.stdout)
    assert passed and collected, rows.stdout[-2000:] + listed.stdout[-2000:]
    assert int(passed.group(1)) == int(collected.group(1)) > 0
