"""Every ratio the CPU suite measured, with its target, from the JSON files of one run_all.sh run.

    python benchmarks/summary.py [--results benchmarks/results] [--docs docs/benchmarks.md]

Rows whose file or key is missing (a benchmark not run) are left out. `ok` is blank where the issue sets no
target: the number is reported, with what an ideal value would be. Also written to summary.json. --docs: the
table between the page's BEGIN and END lines is replaced by these rows, dated by the results (run_all.sh does it
after a full run; a smoke run's numbers are refused).
"""

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BEGIN, END = "<!-- benchmarks/summary.py --docs: begin -->", "<!-- benchmarks/summary.py --docs: end -->"


def get(doc: dict, path: str):
    for key in path.split("."):
        if not isinstance(doc, dict) or key not in doc:
            return None
        doc = doc[key]
    return doc


def cp_row(doc: dict, degree: int, key: str):
    """All-gather CP's row at `degree` for the first sequence length (bench_cp's `seq_len`)."""
    rows = [r for r in (doc or {}).get("results", []) if r.get("method", "allgather") == "allgather"
            and r.get("seq_len", doc.get("seq_len")) == doc.get("seq_len")]
    return next((r[key] for r in rows if r["cp"] == degree), None)


def data_row(doc: dict, degree: int):
    return next((r["ratio"] for r in (doc or {}).get("results", []) if r["dp"] == degree), None)


def prepared_row(doc: dict, degree: int, what: str):
    """prepared / streaming loader's `what` (ms_per_step, mib_read_per_step) at DP `degree`."""
    row = next((r for r in (doc or {}).get("loaders", []) if r["dp"] == degree), None)
    return row and row[f"{what}_streaming"] and row[f"{what}_prepared"] / row[f"{what}_streaming"]


def ep_row(doc: dict, ranks: int, key: str):
    return next((r[key] for r in (doc or {}).get("ep", []) if r["ranks"] == ranks), None)


def rows(t: dict, f: dict, c: dict, d: dict, m: dict, p: dict | None = None) -> list[tuple]:
    """(what, value, format, target, check or None)."""
    def ac(mode: str, key: str):
        return get(f, f"ac.{mode}.{key}")

    return [
        ("trainer / plain eager loop, tokens/s", get(t, "tessera_over_plain"), ".3f", ">= 1.0", lambda v: v >= 1.0),
        ("trainer + compile / plain eager loop", get(t, "compiled_over_plain"), ".3f", ">= 1.3", lambda v: v >= 1.3),
        ("MFU plain loop (vs measured GEMM)", get(t, "plain.mfu"), ".1%", "report", None),
        ("MFU trainer", get(t, "tessera.mfu"), ".1%", "report", None),
        ("MFU trainer + compile", get(t, "tessera_compiled.mfu"), ".1%", "report", None),
        ("loss gap trainer vs plain, round 1", get(t, "tessera.loss_gap_round_1"), ".1e", "~0 (<= 1e-4)",
         lambda v: v <= 1e-4),
        ("FSDP 2 ranks / (2 x 1 rank), 1 thread", get(t, "fsdp.scaling_efficiency"), ".3f", "report (1.0 linear)",
         None),
        ("compile speed-up (trainer on / off)", get(t, "compile_speedup") or get(f, "compile.speedup"), ".3f",
         "> 1.0", lambda v: v > 1.0),
        ("compile first step, s (compilation)", get(t, "tessera_compiled.first_step_s") or
         get(f, "compile.compiled.first_step_s"), ".1f", "report", None),
        ("AC full: activation memory / none", ac("full", "memory_ratio"), ".3f", "< 0.6", lambda v: v < 0.6),
        ("AC selective op: activation memory / none", ac("selective_op", "memory_ratio"), ".3f",
         "< 1.0, > full's", lambda v: ac("full", "memory_ratio") < v < 1.0),
        ("AC full: step time / none", ac("full", "time_ratio"), ".3f", "<= 1.5 (1 fwd extra)", lambda v: v <= 1.5),
        ("AC selective op: step time / none", ac("selective_op", "time_ratio"), ".3f", "<= full's",
         lambda v: v <= ac("full", "time_ratio")),
        ("AC loss gap vs none (full, op), round 1", max(ac("full", "loss_gap_round_1") or 0,
                                                        ac("selective_op", "loss_gap_round_1") or 0)
         if get(f, "ac") else None, ".1e", "0 on CPU (exact)", lambda v: v <= 1e-6),
        (f"float8 {'emulated ' if get(f, 'float8.emulated') else ''}loss gap / loss, {get(f, 'float8.steps')} steps",
         get(f, "float8.loss_gap_relative"), ".2%", "<= 1%", lambda v: v <= 0.01),
        ("float8 speed-up (GPU, both compiled)", get(f, "float8.speedup"), ".3f", "> 1.0", lambda v: v > 1.0),
        ("CP 2 / CP 1 speed-up, 1 thread per rank", cp_row(c, 2, "speedup"), ".3f", "report (2.0 linear)", None),
        ("CP 2 / CP 1 step memory per rank", cp_row(c, 2, "memory_ratio"), ".3f", "< 1.0", lambda v: v < 1.0),
        ("CP 4 / CP 1 step memory per rank", cp_row(c, 4, "memory_ratio"), ".3f", "< CP 2's",
         lambda v: v < cp_row(c, 2, "memory_ratio")),
        ("data, DP 8: rank's loader time, 64 / 1 streams", data_row(d, 8), ".3f", "~1/8 (<= 0.25)",
         lambda v: v <= 0.25),
        ("data, DP 64: loader time, prepared / streaming", prepared_row(p, 64, "ms_per_step"), ".3f", "< 1.0",
         lambda v: v < 1.0),
        ("data, DP 64: bytes read, prepared / streaming", prepared_row(p, 64, "mib_read_per_step"), ".4f",
         "report (~1/64)", None),
        ("prepare: tokens per CPU-second of its tasks", next((r["tokens_per_cpu_second"] for r in (p or {}).get(
            "prepare", [])), None), ",.0f", "report", None),
        ("MoE layer: grouped GEMMs / per-expert loop", get(m, "layer.grouped_over_loop"), ".3f", ">= 1.0",
         lambda v: v >= 1.0),
        ("EP 2: all-to-all share of the step", ep_row(m, 2, "dispatch_share"), ".1%", "report", None),
        ("EP 4: all-to-all share of the step", ep_row(m, 4, "dispatch_share"), ".1%", "report", None),
    ]


def markdown(table: list[dict], fmts: dict[str, str], measured: float) -> str:
    """The docs' table of a run's rows, dated by its results files."""
    day = datetime.datetime.fromtimestamp(measured, datetime.timezone.utc).strftime("%Y-%m-%d")
    lines = [f"CPU figures of {day} ({os.cpu_count()} cores; written by `benchmarks/summary.py --docs` from that "
             f"`benchmarks/run_all.sh` run's results, not by hand):", "", "| measure | value | target | ok |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {r['measure']} | {r['value']:{fmts[r['measure']]}} | {r['target']} | {r['ok']} |" for r in table]
    return "\n".join(lines)


def refuse(message: str) -> None:
    print(f"summary.py: {message}", file=sys.stderr)
    sys.exit(2)


def write_docs(page: Path, text: str) -> None:
    """`text` in place of what lies between the page's BEGIN and END lines."""
    doc = page.read_text()
    if BEGIN not in doc or END not in doc:
        refuse(f"--docs: {page} has no '{BEGIN}' ... '{END}' lines around its table")
    head, rest = doc.split(BEGIN, 1)
    page.write_text(f"{head}{BEGIN}\n{text}\n{END}{rest.split(END, 1)[1]}")
    print(f"  -> {page}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--docs", type=Path, help="a page whose results table to regenerate from these results")
    a = p.parse_args()
    paths = [Path(a.results, n) for n in ("trainer.json", "features.json", "cp.json", "data.json", "moe.json",
                                          "prepared.json")]
    docs = [json.loads(path.read_text()) if path.exists() else {} for path in paths]
    table, fmts, smoke = [], {}, any(doc.get("smoke") for doc in docs)
    if a.docs and (smoke or not any(docs)):
        refuse(f"--docs: {'a smoke run measures nothing' if smoke else 'no results'} in {a.results}; run "
               f"benchmarks/run_all.sh (no --smoke) first")
    if smoke:
        print("\nsmoke run (--smoke: tiny sizes, a few steps): the numbers mean nothing, no target is judged")
    print(f"\n{'measure':<46} {'value':>9}  {'target':<22} ok")
    for what, value, fmt, target, check in rows(*docs):
        if value is None:
            continue
        ok = "" if check is None or smoke else ("yes" if check(value) else "NO")
        table.append({"measure": what, "value": value, "target": target, "ok": ok})
        fmts[what] = fmt
        print(f"{what:<46} {value:>9{fmt}}  {target:<22} {ok}")
    Path(a.results, "summary.json").write_text(json.dumps(table, indent=2))
    print(f"  -> {Path(a.results, 'summary.json')}")
    if a.docs:
        write_docs(a.docs, markdown(table, fmts, max(path.stat().st_mtime for path in paths if path.exists())))


if __name__ == "__main__":
    main()
