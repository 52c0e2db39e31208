"""The H100's records of 2026-11-26 (autotune 0b18d82) as committed rows that the docs cite.

    .venv/bin/python bench/h100_records.py [--h100 DIR] [--json bench/results/h100_records.json]

Reads `../shared/h100/` (its README.md says how the files were made): each probe record's answers
and trial count, and `independent_loop_runs.txt`, the answers run by an independent training loop
in fresh processes (FITS with its steps and peaks, or OOM at an optimizer step with CUDA's
message). Writes one row per probe record (`id`: its case, e.g. `512MiB`) and one per loop run
(`id`: case, batch x micro-steps and the loop, e.g. `512MiB 30x3 job`): what a sentence about
these runs cites (tests/test_gpu_claims.py holds every citation to a row).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_H100 = ROOT.parent / "shared" / "h100"
DEFAULT_JSON = ROOT / "bench" / "results" / "h100_records.json"
RECORDS = {
    "gpt_whole_card.json": "card",
    "gpt_2GiB_headroom0.json": "2GiB",
    "gpt_512MiB_headroom0.json": "512MiB",
    "gpt_512MiB_headroom0_expandable_segments.json": "512MiB expandable",
}
# The loop file's section headers, and the case each names.
SECTIONS = (("expandable", "512MiB expandable"), ("512MiB", "512MiB"), ("2GiB", "2GiB"), ("card", "card"))
RUN = re.compile(
    r"^(?P<verdict>FITS|OOM) (?P<loop>job|drop) b=(?P<batch>\d+) x(?P<micro>\d+)"
    r"(?: steps=(?P<steps>\d+) reserved=(?P<reserved>\d+) alloc=(?P<alloc>\d+))?"
    r"(?: at step (?P<step>\d+) micro-step (?P<micro_step>\d+): (?P<message>.*))?"
)


def probe_rows(directory: Path) -> list[dict[str, Any]]:
    rows = []
    for name, case in RECORDS.items():
        doc = json.loads((directory / name).read_text())
        rows.append(
            {
                "id": case,
                "kind": "probe",
                "file": name,
                "limit_bytes": doc["limit_bytes"],
                "allocator_config": doc.get("allocator_config"),
                "max_micro_batch": doc["max_micro_batch"],
                "max_micro_batch_without_accumulation": doc["max_micro_batch_without_accumulation"],
                "trials": len(doc["trials"]),
                "confirmation": (doc.get("confirmation") or {}).get("status"),
            }
        )
    return rows


def loop_rows(text: str) -> list[dict[str, Any]]:
    rows, case = [], None
    for line in text.splitlines():
        if line.startswith("[t+"):
            header = line.split("]", 1)[1]
            case = next((c for key, c in SECTIONS if key in header), None)
            continue
        found = RUN.match(line)
        if found is None or case is None:
            continue
        g = found.groupdict()
        row: dict[str, Any] = {
            "id": f"{case} {g['batch']}x{g['micro']} {g['loop']}",
            "kind": "independent loop",
            "case": case,
            "batch": int(g["batch"]),
            "micro_steps": int(g["micro"]),
            "loop": g["loop"],
            "fits": g["verdict"] == "FITS",
        }
        if row["fits"]:
            row.update(steps=int(g["steps"]), reserved_bytes=int(g["reserved"]), allocated_bytes=int(g["alloc"]))
        else:
            row.update(step=int(g["step"]), micro_step=int(g["micro_step"]), message=g["message"])
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--h100", type=Path, default=DEFAULT_H100)
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    args = parser.parse_args(argv)
    if not args.h100.is_dir():
        raise SystemExit(f"no H100 records: {args.h100} is not a directory (give it with --h100 DIR)")
    rows = probe_rows(args.h100) + loop_rows((args.h100 / "independent_loop_runs.txt").read_text())
    document = {
        "measured": "2026-11-26, one NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, autotune 0b18d82",
        "source": "../shared/h100/ (its README.md)",
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(document, indent=1) + "\n")
    for row in rows:
        print(row["id"], "fits" if row.get("fits", True) else "OOM")
    print(f"written to {args.json}")


if __name__ == "__main__":
    main()
