"""`megabeta bench trace TRACE.json --out trace.png`: a profiler trace as a timeline picture.

The traces a run's `[profile]` writes (RUN/profile/step_<n>/rank<R>.pt.trace.json, Chrome's
trace format) open in ui.perfetto.dev or TensorBoard's profiler view, which need a browser. This
draws the same flame chart without one (matplotlib, `megabeta[plot]`): one lane per thread (CUDA
streams included), time in ms from the trace's first event, each operator a bar at its nesting
depth, the operators with the most self time (their time minus that of the operators they
called) coloured and listed in the legend with their totals (a long name shortened around where
it differs from the others listed, so a forward and a backward kernel never read the same), the
others grey; names are written in the bars wide enough to hold them. The steps' boundaries (the
`ProfilerStep#<n>` annotations that `megabeta train`'s profiler and torch's scheduled profiler
record) are dashed lines marked with the step.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from megabeta.extras import require

PROG = "megabeta bench trace"
WIDTH, HEIGHT, DPI = 16.0, 8.0, 100
"""The picture's size in inches and its resolution: 1600 x 800 pixels."""
GREY = "#c8c8c8"
STEP_MARK = "ProfilerStep#"
"""The name prefix of a step's annotation in a trace (torch.profiler's own)."""
LEGEND_CHARS = 48
"""The longest operator name in the legend; a longer one is shortened."""


class TraceError(ValueError):
    """The file is not a Chrome trace with operators in it; the message names it."""


@dataclass(frozen=True)
class Span:
    """One complete ("X") event of a trace: an operator, annotation or kernel."""

    name: str
    lane: tuple
    """(pid, tid) of its thread or stream."""
    start: float
    """microseconds"""
    duration: float
    depth: int = 0
    self_time: float = 0.0


def read_trace(path: str | Path) -> tuple[list[Span], dict[tuple, str], list[Span]]:
    """The trace's spans with their nesting depth and self time, the lanes' names, and the
    steps (`ProfilerStep#<n>` annotations, in time order; not among the spans, whose depths
    they would all shift). TraceError naming the file for anything that is not a Chrome trace
    of operators."""
    path = Path(path)
    hint = ("pass a Chrome trace of a profiled run, RUN/profile/step_<n>/rank<R>.pt.trace.json "
            "(written with [profile] steps = \"A-B\")")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file; {hint}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TraceError(f"{path}: not JSON ({err}); {hint}") from None
    events = raw.get("traceEvents") if isinstance(raw, dict) else raw
    if not isinstance(events, list):
        raise TraceError(f"{path}: no traceEvents list, so not a Chrome trace; {hint}")
    names = {(e.get("pid"), e.get("tid")): e["args"]["name"] for e in events
             if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name"
             and isinstance(e.get("args"), dict) and "name" in e["args"]}
    # The profiler's own "Trace" span covers the whole recording on a lane of its own: no
    # operator, so left out.
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
                and e.get("cat") != "Trace" and isinstance(e.get("ts"), (int, float))
                and isinstance(e.get("dur"), (int, float))]
    steps = sorted((Span(str(e["name"]), (e.get("pid"), e.get("tid")), float(e["ts"]),
                         float(e["dur"])) for e in complete
                    if str(e.get("name", "")).startswith(STEP_MARK)), key=lambda s: s.start)
    complete = [e for e in complete if not str(e.get("name", "")).startswith(STEP_MARK)]
    if not complete:
        raise TraceError(f"{path}: a trace without complete (\"X\") events, nothing to draw; "
                         f"{hint}")
    return _nest(complete), names, steps


def _nest(events: list[dict]) -> list[Span]:
    """Depth and self time of every event: within a lane, an event that starts inside another
    and ends by its end is its child (how Chrome's trace viewer stacks them)."""
    spans: list[Span] = []
    by_lane: dict[tuple, list[dict]] = defaultdict(list)
    for event in events:
        by_lane[(event.get("pid"), event.get("tid"))].append(event)
    for lane, lane_events in by_lane.items():
        lane_events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[tuple[float, int]] = []  # (end, index in spans) of the open ancestors
        children: dict[int, float] = defaultdict(float)
        first = len(spans)
        for event in lane_events:
            start, duration = float(event["ts"]), float(event["dur"])
            while stack and start >= stack[-1][0]:
                stack.pop()
            if stack:
                children[stack[-1][1]] += duration
            spans.append(Span(str(event.get("name", "?")), lane, start, duration, len(stack)))
            stack.append((start + duration, len(spans) - 1))
        for index in range(first, len(spans)):
            span = spans[index]
            spans[index] = Span(span.name, span.lane, span.start, span.duration, span.depth,
                                max(span.duration - children[index], 0.0))
    return spans


def top_operators(spans: list[Span], count: int) -> list[tuple[str, float, int]]:
    """(name, total self time in µs, calls) of the `count` names with the most self time."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for span in spans:
        totals[span.name][0] += span.self_time
        totals[span.name][1] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:count]
    return [(name, total, int(calls)) for name, (total, calls) in ranked]


def legend_labels(names: list[str], width: int = LEGEND_CHARS) -> dict[str, str]:
    """A label of at most about `width` characters per name, different names different labels:
    a long name keeps its start and, when its first `width` characters are another's too, the
    part around where it differs from the closest of them (kernels' names share long template
    prefixes: `...elementwise_kernel<...silu_kernel...>` and `...silu_backward_kernel...`)."""
    labels: dict[str, str] = {}
    for name in names:
        shared = max((len(os.path.commonprefix([name, other])) for other in names
                      if other != name), default=0)
        if len(name) <= width:
            labels[name] = name
        elif shared < width - 1:
            labels[name] = name[:width - 1] + "…"
        else:
            head = width // 3
            tail = width - head - 2
            start = max(head, min(shared - tail // 3, len(name) - tail))
            labels[name] = (name[:head] + "…" + name[start:start + tail]
                            + ("…" if start + tail < len(name) else ""))
    seen: dict[str, int] = defaultdict(int)
    for name in names:  # windows that still coincide: numbered
        seen[labels[name]] += 1
        if seen[labels[name]] > 1:
            labels[name] += f" ({seen[labels[name]]})"
    return labels


def render_trace(path: str | Path, out: str | Path, *, top: int = 10, max_depth: int = 8,
                 zoom: tuple[float, float] | None = None) -> Path:
    """Draw the trace at `path` as a WIDTH x HEIGHT inch PNG at `out`, returned: above, the
    whole trace; below, the window `zoom` (ms from the first event; default: a twelfth of the
    trace from the first call of the top operator) with the operators' names. Lanes of spans
    nested up to `max_depth` levels, the `top` operators by self time coloured."""
    spans, lane_names, steps = read_trace(path)
    require("matplotlib", "plot", PROG)
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    leaders = top_operators(spans, top)
    palette = matplotlib.colormaps["tab10" if top <= 10 else "tab20"]
    colours = {name: palette(i % palette.N) for i, (name, _, _) in enumerate(leaders)}
    origin = min(span.start for span in spans + steps)
    end_ms = (max(span.start + span.duration for span in spans) - origin) / 1e3
    if zoom is None:
        first = min((s for s in spans if s.name == leaders[0][0]), key=lambda s: s.start)
        begin = (first.start - origin) / 1e3
        zoom = (begin, min(begin + end_ms / 12, end_ms))

    figure = Figure(figsize=(WIDTH, HEIGHT), dpi=DPI, layout="constrained")
    whole, detail = figure.subplots(2, 1, height_ratios=[1, 1.4])
    _draw(whole, spans, lane_names, colours, origin, (0.0, end_ms), max_depth, labels=False)
    _mark_steps(whole, steps, origin, (0.0, end_ms))
    whole.axvspan(*zoom, color="black", alpha=0.08)
    whole.set_title(f"{Path(path).name}: {end_ms:.1f} ms, {len(spans):,} events, callers above "
                    f"callees; the shaded window is drawn below", fontsize=10)
    _draw(detail, spans, lane_names, colours, origin, zoom, max_depth, labels=True)
    _mark_steps(detail, steps, origin, zoom)
    detail.set_title(f"{zoom[0]:.1f}-{zoom[1]:.1f} ms", fontsize=10)
    detail.set_xlabel("time from the trace's first event (ms)")
    labels = legend_labels([name for name, _, _ in leaders])
    figure.legend(handles=[Patch(color=colours[name], label=f"{labels[name]}: {total / 1e3:.1f} "
                                                            f"ms self, {calls} calls")
                           for name, total, calls in leaders] +
                  [Patch(color=GREY, label="other operators")],
                  loc="outside lower center", ncols=3, fontsize=8,
                  title=f"the top {len(leaders)} operators by self time (their time minus their "
                        "callees')", title_fontsize=9)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)
    return out


def _mark_steps(ax, steps: list[Span], origin: float, window: tuple[float, float]) -> None:
    """A dashed line where each step starts (and the last one ends), with the step's number."""
    low, high = window
    edges = [((s.start - origin) / 1e3, s.name.removeprefix(STEP_MARK)) for s in steps]
    if steps:
        edges.append(((steps[-1].start + steps[-1].duration - origin) / 1e3, None))
    for x, number in edges:
        if low <= x <= high:
            ax.axvline(x, color="black", linestyle="dashed", linewidth=0.8)
        if number is not None and low <= x < high:
            ax.annotate(f"step {number}", (x, 0), xycoords=("data", "axes fraction"),
                        xytext=(3, 3), textcoords="offset points", fontsize=8)


def _draw(ax, spans: list[Span], lane_names: dict[tuple, str], colours: dict[str, tuple],
          origin: float, window: tuple[float, float], max_depth: int, *, labels: bool) -> None:
    """The spans within `window` (ms) on `ax`: a band of rows per lane, one row per depth."""
    from matplotlib.collections import PolyCollection

    lanes = sorted({span.lane for span in spans}, key=str)
    depth = {lane: min(max(s.depth for s in spans if s.lane == lane), max_depth - 1) + 1
             for lane in lanes}
    offsets, rows = {}, 0
    for lane in lanes:
        offsets[lane] = rows
        rows += depth[lane] + 1  # a gap row between lanes
    low, high = window
    # About 200 characters of 7 pt fit across the axes; a bar gets a name where 5 of them fit.
    chars_per_ms = 200 / (high - low)
    bars, faces = [], []
    for span in spans:
        x0, width = (span.start - origin) / 1e3, span.duration / 1e3
        if span.depth >= max_depth or x0 > high or x0 + width < low:
            continue
        y = offsets[span.lane] + span.depth
        bars.append([(x0, y), (x0 + width, y), (x0 + width, y + 0.85), (x0, y + 0.85)])
        faces.append(colours.get(span.name, GREY))
        room = int((min(x0 + width, high) - max(x0, low)) * chars_per_ms)
        if labels and room >= 5:
            name = span.name if len(span.name) <= room else span.name[:room - 1] + "…"
            ax.text((max(x0, low) + min(x0 + width, high)) / 2, y + 0.43, name, ha="center",
                    va="center", fontsize=7, clip_on=True)
    ax.add_collection(PolyCollection(bars, facecolors=faces, edgecolors="none"))
    ax.set_xlim(low, high)
    ax.set_ylim(rows - 1, 0)  # depth 0 on top
    ax.set_yticks([offsets[lane] + depth[lane] / 2 for lane in lanes],
                  [lane_names.get(lane, f"pid {lane[0]} tid {lane[1]}") for lane in lanes])
    ax.grid(axis="x", alpha=0.3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Draw a profiler trace (RUN/profile/step_<n>/rank<R>.pt.trace"
                               ".json of a run with [profile]) as a timeline PNG: lanes per "
                               "thread, time in ms, the top operators by self time coloured.")
    parser.add_argument("trace", help="a Chrome trace JSON written by the profiler")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--top", type=int, default=10,
                        help="operators coloured and listed, by self time (default: 10)")
    parser.add_argument("--max-depth", type=int, default=8,
                        help="nesting levels drawn per lane (default: 8)")
    parser.add_argument("--zoom", metavar="A-B",
                        help="the window of the lower panel, in ms from the first event (default: "
                             "a twelfth of the trace from the top operator's first call)")
    args = parser.parse_args(argv)
    zoom = None
    if args.zoom:
        try:
            zoom = tuple(float(v) for v in args.zoom.split("-", 1))
        except ValueError:
            parser.error(f"--zoom {args.zoom}: give the window as A-B in ms, e.g. 20-35")
        if len(zoom) != 2 or not zoom[0] < zoom[1]:
            parser.error(f"--zoom {args.zoom}: give the window as A-B in ms with A < B")
    try:
        out = render_trace(args.trace, args.out, top=args.top, max_depth=args.max_depth,
                           zoom=zoom)
    except TraceError as err:
        parser.error(str(err))
    print(f"wrote {out}")


__all__ = ["Span", "TraceError", "legend_labels", "main", "read_trace", "render_trace",
           "top_operators"]
