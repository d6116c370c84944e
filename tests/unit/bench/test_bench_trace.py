"""`megabeta bench trace`: a profiler's Chrome trace drawn as a timeline PNG, and a clear error
for a file that is not one."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from megabeta.bench.__main__ import main as bench_main
from megabeta.bench.trace import HEIGHT, WIDTH, DPI, read_trace, top_operators

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    """A real trace of torch.profiler: a few nested operators on one thread."""
    path = tmp_path_factory.mktemp("trace") / "rank0.pt.trace.json"
    layer = torch.nn.Linear(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        for _ in range(3):
            with torch.profiler.record_function("step"):
                layer(torch.randn(32, 64)).relu().sum().backward()
    profiler.export_chrome_trace(str(path))
    return path


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", header[16:24])


def test_the_trace_is_drawn_at_the_expected_size(trace, tmp_path, capsys):
    out = tmp_path / "images" / "trace.png"
    assert bench_main(["trace", str(trace), "--out", str(out), "--top", "4"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert png_size(out) == (int(WIDTH * DPI), int(HEIGHT * DPI))
    assert out.stat().st_size > 20_000  # bars, names and a legend, not an empty canvas


def test_nesting_and_self_time_follow_the_trace(trace):
    spans, lanes, _ = read_trace(trace)
    steps = [s for s in spans if s.name == "step"]
    assert len(steps) == 3 and all(s.depth == 0 for s in steps)
    linear = next(s for s in spans if s.name == "aten::linear")
    assert linear.depth == 1 and linear.self_time < linear.duration  # addmm runs inside it
    assert len(top_operators(spans, 4)) == 4 and lanes


@pytest.mark.parametrize("content, message", [
    ('{"loss": 1.0}', "no traceEvents list, so not a Chrome trace"),
    ('{"traceEvents": [{"ph": "M", "name": "thread_name"}]}',
     'a trace without complete ("X") events'),
    ("not json", "not JSON"),
])
def test_a_file_that_is_no_trace_is_a_clear_error(tmp_path, capsys, content, message):
    path = tmp_path / "metrics.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as caught:
        bench_main(["trace", str(path), "--out", str(tmp_path / "x.png")])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert f"{path}: {message}" in err and "RUN/profile/step_<n>/rank<R>.pt.trace.json" in err
    assert not (tmp_path / "x.png").exists()


def test_legend_labels_of_long_names_that_share_their_start_differ():
    """Kernels' names share long template prefixes: cut to their first 48 characters, a forward
    and a backward kernel read the same in the legend."""
    from megabeta.bench.trace import LEGEND_CHARS, legend_labels

    stem = "void at::native::vectorized_elementwise_kernel<4, at::native::"
    names = [stem + "silu_kernel(at::TensorIteratorBase&)::{lambda(float)#1}>",
             stem + "silu_backward_kernel(at::TensorIteratorBase&)::{lambda(float)#1}>",
             "aten::mm", "a" * 30 + "b" * 40, "a" * 30 + "c" * 40]
    labels = legend_labels(names)
    assert len(set(labels.values())) == len(names), labels
    assert labels["aten::mm"] == "aten::mm"
    assert all(len(label) <= LEGEND_CHARS + 5 for label in labels.values()), labels
    assert "silu_backward" in labels[names[1]] and "silu_k" in labels[names[0]], labels


def test_step_boundaries_are_read_from_the_steps_annotations(tmp_path):
    """`ProfilerStep#<n>` annotations (what `megabeta train`'s profiler records around each
    step) are the steps, not operators: they nest nothing a level deeper."""
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1,
               "tid": 1, "ts": 1000.0 * n, "dur": 900.0} for n in (3, 4)]
    events += [{"ph": "X", "cat": "cpu_op", "name": op, "pid": 1, "tid": 1, "ts": ts,
                "dur": 300.0} for op, ts in (("aten::mm", 3100.0), ("aten::add", 4100.0))]
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(__import__("json").dumps({"traceEvents": events}))
    spans, _, steps = read_trace(path)
    assert [s.name for s in steps] == ["ProfilerStep#3", "ProfilerStep#4"]
    assert {s.name: s.depth for s in spans} == {"aten::mm": 0, "aten::add": 0}
    out = tmp_path / "trace.png"
    assert bench_main(["trace", str(path), "--out", str(out)]) == 0
    assert png_size(out) == (int(WIDTH * DPI), int(HEIGHT * DPI))
