"""Where a training step's time goes, read from a torch.profiler Chrome trace.

The trace holds, per recorded optimizer step, a host range ``dspark:step#<n>`` and inside it the
step's phases (``core.phases``: ``dspark:target_forward``, ``dspark:backward`` …, nested). Every
kernel is charged to the step and to the innermost phase that was open on the host when it was
*launched* (its launch call shares the kernel's correlation id): launch time, not the thread, so
the kernels that autograd's device thread launches during ``backward`` are backward's. On the CPU
there are no kernels; the tables then hold the operators' own CPU times.

``step_report(events, steps)`` returns per-step means: host wall time, device time (the sum of
kernel times and their union, the busy share of the device's timeline, the launch-to-start lag),
host calls that wait for the device, kernels and host operators per step, per phase (inclusive
and self), the top kernels and the runtime calls. ``markdown(report)`` renders it.
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..core.phases import PREFIX, STEP

KERNELS = {"kernel", "gpu_memcpy", "gpu_memset"}  # device activity
LAUNCHES = {"cuda_runtime", "cuda_driver"}  # host calls that start it (cudaLaunchKernel, cuLaunchKernel …)
OUTSIDE = "(outside phases)"  # step time in no phase: Lightning's loop, callbacks, the data fetch
EPS = 1e-3  # µs: trace times are rounded to the nanosecond, so a child can overrun its parent by that


def blocking(call: str) -> bool:
    """Host calls that wait for the device: synchronisations and synchronous copies."""
    return "Synchronize" in call or call in ("cudaMemcpy", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2")


def read_trace(path: str | Path) -> list[dict]:
    """The complete ('X') events of a Chrome trace file (gzipped or not)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        events = json.load(f)
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


@dataclass
class Span:
    name: str
    ts: float
    end: float
    tid: object = None
    children: list = field(default_factory=list)

    @classmethod
    def of(cls, e: dict) -> Span:
        ts = float(e["ts"])
        return cls(e["name"], ts, ts + float(e["dur"]), e.get("tid"))

    def holds(self, t: float) -> bool:
        return self.ts - EPS <= t < self.end + EPS


def nest(spans: list[Span]) -> list[Span]:
    """Spans of one thread as a forest (a span inside another's time is its child); the roots."""
    roots: list[Span] = []
    stack: list[Span] = []
    for s in sorted(spans, key=lambda s: (s.ts, -(s.end - s.ts))):
        while stack and s.ts >= stack[-1].end - EPS:
            stack.pop()
        (stack[-1].children if stack else roots).append(s)
        stack.append(s)
    return roots


def _paths(roots: list[Span], prefix: str = "") -> list[tuple[str, Span]]:
    """(path, span) of a forest, parents before children; a path joins the phase names with '/'."""
    out = []
    for s in roots:
        path = prefix + s.name[len(PREFIX) :]
        out.append((path, s))
        out += _paths(s.children, path + "/")
    return out


def _innermost(phases: list[tuple[str, Span]], t: float) -> str:
    """The path of the deepest phase open at host time ``t`` (parents come before children)."""
    found = OUTSIDE
    for path, s in phases:
        if s.holds(t):
            found = path
    return found


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _self_times(ops: list[Span]) -> list[tuple[Span, float, bool]]:
    """(op, its own time without the operators it called, whether it is top level) per thread."""
    out = []
    by_thread = defaultdict(list)
    for op in ops:
        by_thread[op.tid].append(op)
    for spans in by_thread.values():
        for root in nest(spans):
            todo = [(root, True)]
            while todo:
                op, top = todo.pop()
                out.append((op, (op.end - op.ts) - sum(c.end - c.ts for c in op.children), top))
                todo += [(c, False) for c in op.children]
    return out


def step_report(events: list[dict], steps: list[int], top: int = 30) -> dict:
    """Per-step means over the recorded steps whose global step is in ``steps`` (see the module
    doc); the trace's other step ranges (a warm-up) are left out."""
    recorded = sorted((Span.of(e) for e in events if e.get("cat") == "user_annotation"
                       and e["name"].startswith(STEP)), key=lambda s: s.ts)  # fmt: skip
    wanted = {f"{STEP}{n}" for n in steps}
    kept = [s for s in recorded if s.name in wanted]
    if not kept:
        raise ValueError(f"the trace holds none of the steps {list(steps)} ({len(recorded)} recorded)")
    phases = [Span.of(e) for e in events if e.get("cat") == "user_annotation"
              and e["name"].startswith(PREFIX) and not e["name"].startswith(STEP)]  # fmt: skip
    launches = {}
    for e in events:
        if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = float(e["ts"])
    kernels = [(Span.of(e), launches.get(e.get("args", {}).get("correlation")))
               for e in events if e.get("cat") in KERNELS]  # fmt: skip
    ops = [Span.of(e) for e in events if e.get("cat") == "cpu_op"]
    calls = [Span.of(e) for e in events if e.get("cat") in LAUNCHES]
    cuda = bool(kernels)

    # Per step: its phase tree, and everything charged to the phase open at its (launch) time.
    rows: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    kernel_rows: dict[str, dict] = defaultdict(lambda: defaultdict(float))
    per_step = defaultdict(list)
    lags, step_kernels, runtime = [], [], defaultdict(lambda: [0, 0.0])
    own = _self_times(ops)
    for step in kept:
        roots = nest([p for p in phases if p.tid == step.tid and step.ts - EPS <= p.ts <= step.end])
        tree = _paths(roots)
        for path, s in tree:
            rows[path]["host_ms"] += (s.end - s.ts) / 1e3
            rows[path]["self_host_ms"] += (s.end - s.ts - sum(c.end - c.ts for c in s.children)) / 1e3
        rows[OUTSIDE]["self_host_ms"] += (step.end - step.ts - sum(s.end - s.ts for s in roots)) / 1e3
        mine = [(k, t) for k, t in kernels if t is not None and step.holds(t)]
        step_kernels += [k for k, _ in mine]
        for k, t in mine:
            path = _innermost(tree, t)
            rows[path]["self_device_ms"] += (k.end - k.ts) / 1e3
            rows[path]["self_kernels"] += 1
            kernel_rows[k.name]["us"] += k.end - k.ts
            kernel_rows[k.name]["calls"] += 1
            kernel_rows[k.name][path] += k.end - k.ts
            lags.append((k.ts - t) / 1e3)
        host_ops = 0
        for op, self_us, top_level in own:
            if not step.holds(op.ts):
                continue
            path = _innermost(tree, op.ts)
            if top_level:
                rows[path]["host_ops"] += 1
                host_ops += 1
            if not cuda:  # the CPU's "kernels": each operator's own time
                kernel_rows[op.name]["us"] += self_us
                kernel_rows[op.name]["calls"] += 1
                kernel_rows[op.name][path] += self_us
        waited = 0.0
        for c in calls:
            if step.holds(c.ts):
                runtime[c.name][0] += 1
                runtime[c.name][1] += (c.end - c.ts) / 1e3
                waited += (c.end - c.ts) / 1e3 if blocking(c.name) else 0.0
        device = [(k.ts, k.end) for k, _ in mine]
        per_step["host_ms"].append((step.end - step.ts) / 1e3)
        per_step["device_ms"].append(sum(b - a for a, b in device) / 1e3)
        per_step["device_busy_ms"].append(_union(device) / 1e3)
        per_step["kernels"].append(len(mine))
        per_step["host_ops"].append(host_ops)
        per_step["blocking_calls_ms"].append(waited)

    n = len(kept)
    mean = {k: sum(v) / n for k, v in per_step.items()}
    summary = {
        "host_ms": mean["host_ms"],
        "host_ms_each": per_step["host_ms"],
        "host_ops": mean["host_ops"],
        "device_ms": mean["device_ms"] if cuda else None,
        "device_busy_ms": mean["device_busy_ms"] if cuda else None,
        "kernels": mean["kernels"] if cuda else None,
        "blocking_calls_ms": mean["blocking_calls_ms"] if cuda else None,
    }
    if cuda and step_kernels:
        # The device's timeline from the first to the last kernel these steps launched: the share
        # it was busy. Near 1: the device is the bound; well below: it waited for the host.
        span = max(k.end for k in step_kernels) - min(k.ts for k in step_kernels)
        busy = _union([(k.ts, k.end) for k in step_kernels])
        summary["device_span_ms"] = span / 1e3 / n
        summary["device_idle_ms"] = (span - busy) / 1e3 / n
        summary["device_utilization"] = busy / span if span > 0 else None
        summary["launch_lag_ms"] = {
            "median": statistics.median(lags),
            "p90": sorted(lags)[int(0.9 * (len(lags) - 1))],
            "max": max(lags),
        }
    fields = ("host_ms", "self_host_ms", "device_ms", "self_device_ms", "kernels", "self_kernels", "host_ops")
    table = []
    for path in sorted(rows, key=lambda p: (p == OUTSIDE, p)):
        r = rows[path]
        # Inclusive device time and kernels: the phase's own plus its descendants'.
        below = [q for q in rows if q == path or q.startswith(path + "/")]
        r["device_ms"] = sum(rows[q]["self_device_ms"] for q in below)
        r["kernels"] = sum(rows[q]["self_kernels"] for q in below)
        if path == OUTSIDE:
            r["host_ms"] = r["self_host_ms"]
        row = {"phase": path, **{f: r[f] / n for f in fields}}
        if not cuda:
            for f in ("device_ms", "self_device_ms", "kernels", "self_kernels"):
                row[f] = None
        table.append(row)
    total = sum(r["us"] for r in kernel_rows.values()) or 1.0
    tops = sorted(kernel_rows.items(), key=lambda kv: -kv[1]["us"])[:top]
    top_rows = []
    for name, r in tops:
        where = max((k for k in r if k not in ("us", "calls")), key=lambda k: r[k])
        top_rows.append({"name": name[:160], "phase": where, "calls": r["calls"] / n, "us": r["us"] / n,
                         "share": r["us"] / total})  # fmt: skip
    return {
        "device": "cuda" if cuda else "cpu",
        "timeline": "device" if cuda else "host",  # what top_kernels' times are
        "steps_recorded": len(recorded),
        "steps_reported": n,
        "per_step": summary,
        "phases": table,
        "top_kernels": top_rows,
        "runtime_calls": [
            {"name": k, "calls": c / n, "ms": ms / n, "blocking": blocking(k)}
            for k, (c, ms) in sorted(runtime.items(), key=lambda kv: -kv[1][1])[:15]
        ],
    }


def _f(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def reading(report: dict) -> str:
    """One sentence on what bounds the step, from the numbers (no judgement beyond them)."""
    s = report["per_step"]
    if report["device"] != "cuda":
        return "CPU run: host times only (no device timeline)."
    util, host, busy = s.get("device_utilization"), s["host_ms"], s["device_busy_ms"]
    lag = (s.get("launch_lag_ms") or {}).get("median")
    waits = s["blocking_calls_ms"] or 0.0
    parts = [f"The device was busy {100 * (util or 0):.0f} % of its timeline "
             f"({_f(busy)} ms of kernels per {_f(host)} ms step)"]  # fmt: skip
    if lag is not None:
        parts.append(f"a kernel started {_f(lag, 3)} ms after its launch (median)")
    if waits > 0.05 * host:
        parts.append(f"the host waited {_f(waits)} ms per step in synchronising calls")
    if util is not None and util >= 0.9:
        ahead = "the host runs ahead" if (lag or 0) > 1.0 else "the host only just keeps up"
        verdict = f"device-bound ({ahead}): the kernels are the cost"
    elif util is not None and util < 0.7:
        verdict = "the device idles: the host (Python, launches, or a wait) is the bound"
    else:
        verdict = "mixed: neither side idles for long"
    return "; ".join(parts) + f". Reading: {verdict}."


def markdown(report: dict) -> str:
    """The report as markdown: the step, the phases (indented by nesting), kernels, runtime calls."""
    s = report["per_step"]
    cuda = report["device"] == "cuda"
    steps = report.get("steps") or []
    if steps:
        span = f"steps {steps[0]}–{steps[-1]}" if len(steps) > 1 else f"step {steps[0]}"
    else:
        span = f"{report['steps_reported']} steps"
    lines = [f"# Training step profile: {span}, {report.get('device_name') or report['device']}", ""]
    lines += [reading(report), ""]
    if report.get("validation_in_window"):
        lines += ["A validation ran inside the window: its time is in the steps.", ""]
    lines += ["| per step | value |", "|---|---:|", f"| host wall ms | {_f(s['host_ms'])} |"]
    if report.get("unprofiled_step_ms") is not None:
        lines.append(f"| wall ms without the profiler (median of the steps before) | "
                     f"{_f(report['unprofiled_step_ms'])} |")  # fmt: skip
    lines.append(f"| host operators (top level) | {_f(s['host_ops'], 0)} |")
    if cuda:
        lag = s.get("launch_lag_ms") or {}
        lines += [
            f"| kernels | {_f(s['kernels'], 0)} |",
            f"| device ms (sum of kernels) | {_f(s['device_ms'])} |",
            f"| device busy ms (their union) | {_f(s['device_busy_ms'])} |",
            f"| device idle ms (gaps between them) | {_f(s.get('device_idle_ms'))} |",
            f"| device utilization | {_f(s.get('device_utilization'), 3)} |",
            f"| launch → start lag ms (median / p90) | {_f(lag.get('median'), 3)} / "
            f"{_f(lag.get('p90'), 3)} |",
            f"| host ms in synchronising calls | {_f(s['blocking_calls_ms'])} |",
        ]
    if report.get("peak_memory_gib") is not None:
        lines.append(f"| peak memory GiB | {_f(report['peak_memory_gib'])} |")
    lines += ["", "## Phases (ms per step; self: not in a nested phase)", ""]
    if cuda:
        lines += ["| phase | host | self host | device | self device | kernels | self kernels | host ops |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    else:
        lines += ["| phase | host | self host | host ops |", "|---|---:|---:|---:|"]
    for r in report["phases"]:
        depth = r["phase"].count("/")
        name = ("  " * depth + "· " if depth else "") + r["phase"].rsplit("/", 1)[-1]
        cells = [_f(r["host_ms"]), _f(r["self_host_ms"])]
        if cuda:
            cells += [_f(r["device_ms"], 3), _f(r["self_device_ms"], 3)]
            cells += [_f(r["kernels"], 0), _f(r["self_kernels"], 0)]
        cells.append(_f(r["host_ops"], 0))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    what = "kernels by device time" if cuda else "operators by own CPU time"
    lines += ["", f"## Top {what} (per step)", ""]
    lines += ["| name | phase | calls | µs | share |", "|---|---|---:|---:|---:|"]
    for r in report["top_kernels"]:
        name = r["name"].replace("|", "\\|")
        lines.append(f"| `{name[:100]}` | {r['phase']} | {_f(r['calls'], 1)} | {_f(r['us'], 1)} | "
                     f"{100 * r['share']:.1f} % |")  # fmt: skip
    if report["runtime_calls"]:
        lines += ["", "## Runtime calls (host ms per step)", ""]
        lines += ["| call | calls | ms | waits for the device |", "|---|---:|---:|---|"]
        for r in report["runtime_calls"]:
            waits = "yes" if r["blocking"] else ""
            lines.append(f"| {r['name']} | {_f(r['calls'], 1)} | {_f(r['ms'], 3)} | {waits} |")
    return "\n".join(lines) + "\n"
