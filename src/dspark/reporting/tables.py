"""Markdown tables from evaluation results (``results.json``, see ``dspark.evaluate``)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DOMAIN_ORDER", "PRETTY", "table1"]

DOMAIN_ORDER = ("math", "code", "chat")
PRETTY = {
    "gsm8k": "GSM8K",
    "math500": "MATH",
    "aime25": "AIME25",
    "mbpp": "MBPP",
    "humaneval": "HumanEval",
    "livecodebench": "LCB",
    "lcb": "LCB",
    "mt-bench": "MT-Bench",
    "alpaca": "Alpaca",
    "arena-hard": "Arena-Hard",
}


def _fmt(v, err=None) -> str:
    if v is None:
        return "–"
    return f"{v:.2f}" if err is None else f"{v:.2f} ± {err:.2f}"


def table1(results: Sequence[dict], domains: dict[str, str] | None = None) -> str:
    """Paper Table 1 layout: one row per (target, drafter) run, benchmark τ grouped by domain,
    then the macro averages; the best value of each column is bold when there are several rows.
    A value is followed by ``± <standard error>`` where the results carry one (``tau_stderr`` per
    benchmark, ``macro_stderr``).

    ``domains`` maps benchmark -> domain (default: each result's own ``domains`` key, else the
    macro grouping is left to the ``macro`` numbers in the results)."""
    if not results:
        return ""
    domains = dict(domains or {})
    for res in results:
        domains.update(res.get("domains", {}))
    names: list[str] = []
    for res in results:
        for name in res["benchmarks"]:
            if name not in names:
                names.append(name)
    rank = {d: i for i, d in enumerate(DOMAIN_ORDER)}
    names.sort(key=lambda n: rank.get(domains.get(n, ""), len(rank)))  # stable: file order within a domain
    macro_keys = [
        d for d in (*DOMAIN_ORDER, "all") if any(res.get("macro", {}).get(d) is not None for res in results)
    ]

    header = ["Target", "Drafter"]
    header += [f"{PRETTY.get(n, n)} ({domains[n]})" if n in domains else PRETTY.get(n, n) for n in names]
    header += [f"Macro {k}" for k in macro_keys]
    rows, errs = [], []
    for res in results:
        vals = [res["benchmarks"].get(n, {}).get("tau") for n in names]
        vals += [res.get("macro", {}).get(k) for k in macro_keys]
        rows.append((res.get("target", "?"), res.get("drafter", "?"), vals))
        errs.append(
            [res["benchmarks"].get(n, {}).get("tau_stderr") for n in names]
            + [(res.get("macro_stderr") or {}).get(k) for k in macro_keys]
        )
    best = [max((r[2][j] for r in rows if r[2][j] is not None), default=None) for j in range(len(header) - 2)]
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] * 2 + ["---:"] * (len(header) - 2)) + "|",
    ]
    for (tgt, drf, vals), err in zip(rows, errs):
        cells = []
        for j, v in enumerate(vals):
            s = _fmt(v, err[j])
            cells.append(f"**{s}**" if len(rows) > 1 and v is not None and v == best[j] else s)
        lines.append("| " + " | ".join([str(tgt), str(drf), *cells]) + " |")
    temps = sorted({res.get("temperature") for res in results}, key=str)
    note = (
        "\nτ = accepted draft tokens per round + 1 (bonus/correction token); "
        f"temperature {', '.join(map(str, temps))}."
    )
    if any(e is not None for err in errs for e in err):
        note += " ± one standard error over prompts (ratio estimator, requests as units)."
    return "\n".join(lines) + "\n" + note + "\n"
