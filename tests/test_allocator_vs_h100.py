"""bench/allocator_vs_h100.py's reading of the H100's records, and the measurement it stored
(bench/results/allocator_vs_h100.json, quoted in docs/measurements.md): no trial runs here."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from tests.benches import load_bench
from tests.docs_text import ROOT, prose, section

RESULTS = ROOT / "bench" / "results" / "allocator_vs_h100.json"


@functools.cache
def _stored() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(RESULTS.read_text())
    return document


def test_a_record_reads_as_its_trials() -> None:
    bench = load_bench("allocator_vs_h100")
    trial = {
        "batch": 31,
        "fits": False,
        "micro_steps": 2,
        "prefetch": 0,
        "peak_allocated_bytes": 447218176,
        "peak_reserved_bytes": 488636416,
        "oom_message": "CUDA out of memory. Tried to allocate 62.00 MiB. GPU 0 has a total capacity of 79.18 GiB",
    }
    doc = {
        "workload": {"target": "gpt", "options": {}, "steps": 2},
        "device": {"name": "NVIDIA H100 80GB HBM3", "total_bytes": 85017493504},
        "limit_bytes": 536870912,
        "allocator_config": "expandable_segments:True",
        "versions": {"torch": "2.11.0+cu130"},
        "max_micro_batch": 32,
        "max_micro_batch_without_accumulation": 32,
        "trials": [trial],
    }
    record = bench.h100_record(doc, Path("gpt_512MiB_headroom0_expandable_segments.json"))
    assert record["case"] == "512MiB expandable"
    assert bench.case_name(Path("gpt_whole_card.json")) == "whole card"
    assert (record["limit_bytes"], record["total_bytes"], record["steps"]) == (536870912, 85017493504, 2)
    assert record["trials"] == [
        {
            "batch": 31,
            "micro_steps": 2,
            "prefetch": 0,
            "fits": False,
            "allocated": 447218176,
            "reserved": 488636416,
            "ratio": 1.0926,
            "tried": "62.00 MiB",
        }
    ]


def test_without_records_the_script_says_so_in_one_line(tmp_path: Path) -> None:
    bench = load_bench("allocator_vs_h100")
    with pytest.raises(SystemExit, match=r"^no H100 records: .* is not a directory \(give it with --h100 DIR\)$"):
        bench.main(["--h100", str(tmp_path / "absent")])
    with pytest.raises(SystemExit, match=r"^no H100 records \(\*\.json\) in "):
        bench.main(["--h100", str(tmp_path)])


def test_the_stored_measurement_holds_the_h100s_numbers_and_its_own_summary() -> None:
    bench, stored = load_bench("allocator_vs_h100"), _stored()
    cases = {c["case"]: c for c in stored["cases"]}
    answers = {
        name: (c["h100"]["max_micro_batch"], c["h100"]["max_micro_batch_without_accumulation"])
        for name, c in cases.items()
    }
    assert answers == {
        "512MiB": (30, 29),
        "512MiB expandable": (32, 32),
        "2GiB": (138, 137),
        "whole card": (5415, 5413),
    }
    for case in cases.values():
        for row in case["h100"]["trials"]:
            assert row["ratio"] == round(row["reserved"] / row["allocated"], 4), row
        if "model" not in case:
            assert "AUTOTUNE_MAX_CPU_MEMORY" in case["skipped"]
            continue
        shapes = [(r["batch"], r["micro_steps"], r["prefetch"]) for r in case["h100"]["trials"]]
        for run in case["model"]:  # the CPU's trace alone, with the workspaces, through the card profile
            model = run["trials"]
            assert [(r["batch"], r["micro_steps"], r["prefetch"]) for r in model] == shapes  # the same trials
            assert all(r["steps"] == 2 for r in model if r["fits"])  # the records' two optimizer steps
            assert run["summary"] == bench.compare(case["h100"]["trials"], model)
    # The records themselves, where this machine has them.
    if not bench.DEFAULT_H100.is_dir():
        pytest.skip(f"no {bench.DEFAULT_H100} here to read the records from again")
    assert bench.read_records(bench.DEFAULT_H100) == [c["h100"] for c in stored["cases"]]


# docs/measurements.md's tables, from the stored measurement ------------------------------------
MIB = 2**20


def _name(case: str) -> str:
    return case.replace("MiB", " MiB").replace("GiB", " GiB")


def _both(h100: list[dict[str, Any]], model: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(h, m) for h, m in zip(h100, model, strict=True) if h["fits"] and m["fits"]]


def _gap(h100: list[dict[str, Any]], model: list[dict[str, Any]]) -> str:
    gaps = [(m["allocated"] - h["allocated"]) / MIB for h, m in _both(h100, model)]
    return f"{max(gaps):.1f} to {min(gaps):.1f} MiB".replace("-", "−")


def _verdict(row: dict[str, Any]) -> str:
    tried = "" if row["fits"] else f" ({float(row['tried'].split()[0]):g} MiB)"
    return f"{'fits' if row['fits'] else 'OOM'}{tried}, {row['allocated'] / MIB:.1f}, {row['reserved'] / MIB:.1f}"


def test_the_pages_tables_quote_the_stored_measurement() -> None:
    text = section("docs/measurements.md", "The allocator model against the H100's records")
    quoted = 0
    for case in _stored()["cases"]:
        if "model" not in case:
            assert "The whole-card record is listed, not run" in prose(text)
            continue
        h100 = case["h100"]
        trace, held, card = case["model"]
        assert [trace["workspaces_bytes"], held["workspaces_bytes"]] == [[], [32 * MIB, 32 * MIB]]
        assert (trace["card"], held["card"], card["card"], card["workspaces_bytes"]) == (None, None, "h100", [])

        def answers(a: dict[str, Any]) -> str:
            return f"{a['max_micro_batch']}/{a['max_micro_batch_without_accumulation']}"

        runs = (trace, held, card)
        cells = [
            _name(case["case"]),
            str(len(h100["trials"])),
            " / ".join(str(r["summary"]["fits_agree"]) for r in runs),
            " / ".join(_gap(h100["trials"], r["trials"]) for r in runs),
            " / ".join(
                f"{x:.3f}"
                for x in (
                    held["summary"]["ratio_h100"]["median"],
                    held["summary"]["ratio_model"]["median"],
                    card["summary"]["ratio_model"]["median"],
                )
            ),
            " · ".join(answers(a) for a in (h100, trace["probe"], held["probe"], card["probe"])),
        ]
        assert f"| {' | '.join(cells)} |" in text, cells
        # The card profile answers no case above the H100's record.
        assert card["probe"]["max_micro_batch"] <= h100["max_micro_batch"]
        assert card["probe"]["max_micro_batch_without_accumulation"] <= h100["max_micro_batch_without_accumulation"]
        for h, m, c in zip(h100["trials"], held["trials"], card["trials"], strict=True):
            start = f"| {_name(case['case'])} | {h['batch']} × {h['micro_steps']} |"
            if start in text:  # an edge row
                assert f"{start} {_verdict(h)} | {_verdict(m)} | {_verdict(c)} |" in text
                quoted += 1
    assert quoted == 6
