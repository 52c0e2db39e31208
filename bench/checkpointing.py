"""Activation checkpointing chosen with the micro-batch (`--checkpointing auto`), measured: each case
probed once with the choice, every setting's answers, trials, plan and measured samples/s side by
side, and the setting chosen.

    .venv/bin/python bench/checkpointing.py [--case NAME ...] [--json bench/results/checkpointing.json]

The cases (`--case`, repeatable; default: every budget-device case, or on CUDA the GPU's):

    mlp:64MiB, cnn:64MiB, gpt:256MiB   the built-in examples on the CPU budget device
    gptsmall:10MiB     the `gpt` example 64 wide over 64 tokens (4 layers, vocabulary 512) in 10 MiB,
                       where a micro-batch without checkpointing is 3 samples (docs/checkpointing.md's
                       command)
    decoder:256MiB     a transformers Llama decoder built from its config (random weights, nothing
                       downloaded; 4 layers of 256 over 256 tokens, `decoder` below) on the budget device
    decoder1b:card     on CUDA: a Llama decoder of about 1.1 B parameters (16 layers of 2048, 32 heads,
                       intermediate 5632, 2048 tokens, bf16) on the whole card

Each case is `autotune probe TARGET --checkpointing auto --effective-batch 256 --json` (the GPU case
`--effective-batch 64`) in a fresh CLI process, confirmed in fresh processes as every probe is; the
row of a setting is its candidate in `result.checkpointing`: the answers (accumulating / one
micro-step), the plan, the samples per second of the plan's micro-batch timed in its loop, the peak
and the trials. The decoder's blocks are its `model.layers` (found: the largest ModuleList of one
class). docs/checkpointing.md's table is this script's output on the 2-core CPU VM.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CPU_CASES = ["mlp:64MiB", "cnn:64MiB", "gpt:256MiB", "gptsmall:10MiB", "decoder:256MiB"]
GPU_CASES = ["decoder1b:card"]
TARGETS = {"decoder": "bench.checkpointing:decoder", "decoder1b": "bench.checkpointing:decoder1b", "gptsmall": "gpt"}
OPTIONS = {"gptsmall": ["-o", "width=64", "-o", "layers=4", "-o", "vocab_size=512", "-o", "seq_len=64"]}


def decoder(
    layers: int = 4,
    width: int = 256,
    heads: int = 4,
    intermediate: int = 688,
    seq_len: int = 256,
    vocab_size: int = 8192,
    precision: str = "fp32",
) -> Any:
    """A Llama decoder (transformers' LlamaForCausalLM, built from its config: random weights) at its
    longest sequence, trained on next-token prediction with AdamW."""
    import torch
    import transformers

    from autotune import Workload

    def build() -> torch.nn.Module:
        config = transformers.LlamaConfig(
            hidden_size=width,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            vocab_size=vocab_size,
            max_position_embeddings=seq_len,
            attn_implementation="sdpa",
            use_cache=False,  # training: no key-value cache (a checkpointed forward would keep one alive)
        )
        return transformers.LlamaForCausalLM(config)

    def batch(b: int, device: torch.device) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, vocab_size, (b, seq_len), device=device)
        return {"input_ids": tokens, "labels": tokens}

    return Workload(
        name="decoder",
        build_model=build,
        make_batch=batch,
        loss=lambda model, made: model(**made).loss,
        optimizer="adamw",
        precision=precision,  # type: ignore[arg-type]
        input_spec={"seq_len": seq_len, "vocab_size": vocab_size},
    )


def decoder1b() -> Any:
    """About 1.1 B parameters (TinyLlama's shape), 2048 tokens, bf16 autocast."""
    return decoder(layers=16, width=2048, heads=32, intermediate=5632, seq_len=2048, vocab_size=32000, precision="bf16")


def command(case: str) -> list[str]:
    name, _, memory = case.partition(":")
    target = TARGETS.get(name, name)
    args = [sys.executable, "-m", "autotune.cli", "probe", target, *OPTIONS.get(name, [])]
    args += ["--checkpointing", "auto", "--json"]
    if memory == "card":
        return [*args, "--device", "cuda", "--effective-batch", "64"]
    return [*args, "--device", "cpu", "--memory", memory, "--effective-batch", "256"]


def run_case(case: str) -> dict[str, Any]:
    started = time.perf_counter()
    done = subprocess.run(command(case), capture_output=True, text=True, cwd=ROOT, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        return {"case": case, "error": (done.stdout + done.stderr).strip().splitlines()[-1:], "seconds": seconds}
    result = json.loads(done.stdout)
    choice = result["checkpointing"]
    rows = [
        {
            "setting": c["setting"],
            "max_micro_batch": c["max_micro_batch"],
            "max_micro_batch_without_accumulation": c["max_micro_batch_without_accumulation"],
            "plan": None if c["plan"] is None else [c["plan"]["micro_batch"], c["plan"]["accumulation_steps"]],
            "samples_per_second": c["samples_per_second"],
            "peak_bytes": c["peak_bytes"],
            "trials": len(c["trials"]),
            "chosen": c["setting"] == choice["chosen"],
        }
        for c in choice["candidates"]
    ]
    return {
        "case": case,
        "rows": rows,
        "reason": choice["reason"],
        "confirmed": result["verdict"]["status"],
        "answer": [result["max_micro_batch"], result["max_micro_batch_without_accumulation"]],
        "seconds": seconds,
    }


def table(cases: list[dict[str, Any]]) -> str:
    lines = [
        "| case | setting | max micro-batch (acc / 1 step) | plan | samples/s | peak MiB | trials | chosen |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        if "error" in case:
            lines.append(f"| {case['case']} | error: {case['error']} | | | | | | |")
            continue
        for r in case["rows"]:
            plan = "-" if r["plan"] is None else f"{r['plan'][0]} x {r['plan'][1]}"
            speed = "-" if r["samples_per_second"] is None else f"{r['samples_per_second']:.1f}"
            peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
            answers = f"{r['max_micro_batch']} / {r['max_micro_batch_without_accumulation']}"
            lines.append(
                f"| {case['case']} | {r['setting']} | {answers} | {plan} | {speed} | {peak} | {r['trials']} | "
                f"{'yes' if r['chosen'] else ''} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", help="a case (repeatable); default: this machine's")
    parser.add_argument("--json", type=Path, help="write the rows here too")
    options = parser.parse_args()
    cases = options.case
    if not cases:
        import torch

        cases = GPU_CASES if torch.cuda.is_available() else CPU_CASES
    env_threads = os.environ.get("OMP_NUM_THREADS", "unset")
    found = []
    for case in cases:
        found.append(run_case(case))
        print(json.dumps(found[-1]), file=sys.stderr, flush=True)
    print(table(found))
    for case in found:
        if "error" not in case:
            print(f"{case['case']}: {case['reason']} ({case['seconds']:.0f} s, {case['confirmed']})")
    if options.json is not None:
        document = {"machine": platform.platform(), "omp_num_threads": env_threads, "cases": found}
        options.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
