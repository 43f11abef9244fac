"""Ours against torchtitan, joined from one device call: bench/train_throughput.py's rows and peer_torchtitan.py's.

    python bench/titan_report.py OURS.json|OURS.log TT.json|TT.log [--md]

Each of our rows is set against torchtitan's row of the same micro-batch and precision: bf16 rows
(`ours_liger_compile...`) against `tt_bf16`, float8 rows (`ours_fp8_...`) against `tt_fp8`. A row at a
micro-batch torchtitan did not run (a larger one that only our memory allows) is set against torchtitan's
largest smaller one and our same row there, marked `@mb`. A log works as well
as the --out JSON (a call cut short by its time limit leaves only the log's JSON lines). Rows with a profile
also print their GPU time per kernel family.
"""

from __future__ import annotations

import argparse
import json


def read_rows(path: str) -> list[dict]:
    """Rows from a bench's --out JSON, or from the JSON lines its stdout printed."""
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)["rows"]
    except (json.JSONDecodeError, KeyError, TypeError):
        rows = []
        for line in text.splitlines():
            if line.startswith('{"variant"'):
                rows.append(json.loads(line))
        return rows


def peer_of(variant: str) -> str:
    return "tt_fp8" if variant.startswith("ours_fp8") else "tt_bf16"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ours")
    p.add_argument("tt")
    p.add_argument("--md", action="store_true", help="a Markdown table")
    args = p.parse_args()
    ours, tt = read_rows(args.ours), read_rows(args.tt)
    ref = {(r["variant"], r["micro_batch"]): r for r in tt if r.get("tokens_per_s")}
    base = {(r["variant"], r["micro_batch"]): r for r in ours if r.get("tokens_per_s")}
    sep = " | " if args.md else "  "
    head = ["variant", "mb", "tokens/s", "vs torchtitan", "vs base row", "peak GiB", "tt peak GiB"]
    if args.md:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    else:
        print(f"{'variant':40s} {'mb':>3s} {'tokens/s':>9s} {'vs tt':>6s} {'vs base':>7s} {'GiB':>6s} {'tt GiB':>6s}")
    for r in tt + ours:
        mb = r["micro_batch"]
        if not r.get("tokens_per_s"):
            print(f"{r['variant']:40s} {mb:3d} {'OOM' if r.get('oom') else r.get('error', 'error')[:60]}")
            continue
        peer = ref.get((peer_of(r["variant"]), mb)) if r["variant"].startswith("ours") else None
        root = base.get((r["variant"].split("+")[0], mb)) if "+" in r["variant"] else None
        at = ""  # a micro-batch torchtitan did not run: against its largest smaller one, and our row there
        if r["variant"].startswith("ours") and not peer:
            below = [m for v, m in ref if v == peer_of(r["variant"]) and m < mb]
            if below:
                at = f"@{max(below)}"
                peer = ref[(peer_of(r["variant"]), max(below))]
                root = root or base.get((r["variant"], max(below)))
        vs_tt = f"{r['tokens_per_s'] / peer['tokens_per_s']:.3f}{at}" if peer else "-"
        vs_base = f"{r['tokens_per_s'] / root['tokens_per_s']:.3f}{at if root else ''}" if root else "-"
        tt_gib = f"{peer['peak_gib']:.1f}" if peer else "-"
        cells = [r["variant"], str(mb), f"{r['tokens_per_s']:,.0f}", vs_tt, vs_base, f"{r['peak_gib']:.1f}", tt_gib]
        if args.md:
            print("| " + sep.join(cells).strip() + " |")
        else:
            print(f"{cells[0]:40s} {cells[1]:>3s} {cells[2]:>9s} {vs_tt:>6s} {vs_base:>7s} {cells[5]:>6s} {tt_gib:>6s}")
    for r in ours:
        prof = r.get("profile")
        if not prof:
            continue
        wall, busy = prof["wall_ms"], prof["busy_ms"]
        print(f"\nprofile {r['variant']} mb {r['micro_batch']}: wall {wall:.1f} ms, busy {busy:.1f}")
        for kind, ms in prof["kinds_ms"].items():
            print(f"  {kind:34s} {ms:8.1f} ms {100 * ms / prof['wall_ms']:5.1f} %")
        for name, ms in list(prof["top_kernels_ms"].items())[:12]:
            print(f"    {ms:7.1f} ms  {name[:100]}")


if __name__ == "__main__":
    main()
