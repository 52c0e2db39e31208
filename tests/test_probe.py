"""Whole probes on the CPU budget device: the answer is exact, shown by the trials and by a dense scan."""

from __future__ import annotations

import pytest

from autotune.devices.budget import BudgetDevice
from autotune.engine.probe import ProbeRequest, load_workload, run_probe
from autotune.engine.trial import TrialRunner
from autotune.errors import ConfigError, NotAnOOMError, NothingFitsError, WorkloadError
from autotune.workloads.examples import EXAMPLES

MIB = 2**20
# Two budgets a model (the suite's time keeps the smaller ones: a dense scan costs as much as the answer is large).
BUDGETS = {
    "gpt": [96, 128],
    "cnn": [32, 48],
    "mlp": [64, 72],
}
# Dense scans cover every size up to the answer; the mlp's answers are in the hundreds, so it is
# scanned densely around the answer instead.
MLP_WINDOW = 4


@pytest.mark.parametrize(("name", "mib"), [(n, m) for n, ms in BUDGETS.items() for m in ms])
def test_answer_fits_and_one_more_ooms_and_a_dense_scan_agrees(name: str, mib: int) -> None:
    request = ProbeRequest(target=name, device="cpu", memory=mib * MIB)
    result = run_probe(request)
    b = result.max_micro_batch
    # The answer fitted in its loop; b + 1 failed in it or with one micro-step (less memory), where
    # the accumulating search, which starts at the one-micro-step answer, does not try it again.
    at = next(t for t in result.evidence() if t.batch == b and t.fits and t.micro_steps > 1)
    above = next(t for t in result.evidence() if t.batch == b + 1 and not t.fits)
    assert not result.capped
    assert at.peak_reserved_bytes is not None
    assert at.peak_reserved_bytes <= result.limit_bytes < above.peak_reserved_bytes  # type: ignore[operator]
    assert result.limit_bytes == mib * MIB - result.headroom_bytes
    assert result.headroom_bytes == int(0.05 * mib * MIB)

    # The dense scan runs the accumulating loop the answer holds for.
    runner = TrialRunner(load_workload(request), BudgetDevice(mib * MIB, result.limit_bytes), steps=2, micro_steps=2)
    sizes = range(b - MLP_WINDOW, b + 3) if name == "mlp" else range(1, b + 3)
    scan = {size: runner(size).fits for size in sizes}
    first_failure = min(size for size, fits in scan.items() if not fits)
    assert first_failure == b + 1
    assert all(not fits for size, fits in scan.items() if size > b), "memory is not monotone in the batch"


def test_plan_in_the_result() -> None:
    result = run_probe(ProbeRequest(target="cnn", device="cpu", memory=32 * MIB, effective_batch=100))
    assert result.plan is not None
    assert result.plan.max_micro_batch == result.max_micro_batch
    assert result.plan.achieved_effective_batch == 100


def test_cap_reached_is_reported_and_tried() -> None:
    result = run_probe(ProbeRequest(target="cnn", device="cpu", memory=256 * MIB, max_batch=5))
    assert result.capped and result.max_micro_batch == 5
    assert max(t.batch for t in result.trials) == 5


def test_granularity_only_tries_multiples() -> None:
    result = run_probe(ProbeRequest(target="cnn", device="cpu", memory=64 * MIB, granularity=4))
    assert all(t.batch % 4 == 0 for t in result.trials)
    shown = {(t.batch, t.fits) for t in result.evidence()}
    assert (result.max_micro_batch, True) in shown and (result.max_micro_batch + 4, False) in shown


def test_headroom_as_a_size() -> None:
    result = run_probe(ProbeRequest(target="cnn", device="cpu", memory=64 * MIB, headroom="16MiB"))
    assert result.headroom_bytes == 16 * MIB and result.limit_bytes == 48 * MIB
    # The same limit as 48 MiB with no headroom: the same answer.
    same_limit = run_probe(ProbeRequest(target="cnn", device="cpu", memory=48 * MIB, headroom=0))
    assert same_limit.limit_bytes == result.limit_bytes and same_limit.max_micro_batch == result.max_micro_batch


def test_nothing_fits_states_need_and_budget() -> None:
    with pytest.raises(NothingFitsError, match=r"even batch 1 does not fit within a limit of 28\.5 MiB") as info:
        run_probe(ProbeRequest(target="gpt", device="cpu", memory=30 * MIB))
    assert info.value.peak_bytes is not None and info.value.peak_bytes > info.value.limit_bytes


def test_a_non_oom_failure_keeps_the_original_message() -> None:
    with pytest.raises(NotAnOOMError, match="shape mismatch in my data pipeline"):
        run_probe(ProbeRequest(target="tests.workloads:broken", device="cpu", memory=64 * MIB))


@pytest.mark.parametrize(
    ("request_kwargs", "error", "message"),
    [
        ({"target": "resnet"}, WorkloadError, "unknown workload 'resnet'"),
        ({"target": "no_such_module:thing"}, WorkloadError, "cannot import module 'no_such_module'"),
        ({"target": "tests.workloads:missing"}, WorkloadError, "has no attribute 'missing'"),
        ({"target": "tests.workloads:not_a_workload"}, WorkloadError, "returned int, not a Workload"),
        ({"target": "gpt", "options": {"depth": 3}}, WorkloadError, "bad options"),
        ({"target": "gpt", "device": "tpu"}, ConfigError, "unknown device 'tpu'"),
        ({"target": "gpt", "device": "cuda:²"}, ConfigError, "unknown device 'cuda:²'"),
        ({"target": "gpt", "device": "cpu", "headroom": "1GiB", "memory": "512MiB"}, ConfigError, "leaves nothing"),
    ],
)
def test_bad_requests(request_kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        run_probe(ProbeRequest(**request_kwargs))


def test_fingerprint_is_stable_and_changes_with_what_determines_memory() -> None:
    from autotune.engine.probe import device_info, open_device, result_fingerprint

    def key(**kwargs: object) -> str:
        request = ProbeRequest(**{"target": "gpt", "device": "cpu", "memory": 128 * MIB, **kwargs})
        device, *_ = open_device(request)
        return result_fingerprint(load_workload(request), request, device_info(device), device)

    base = key()
    assert key() == base
    changes = [
        {"options": {"seq_len": 64}},
        {"options": {"width": 128}},
        {"precision": "bf16"},
        {"optimizer": "sgd"},
        {"steps": 3},
        {"memory": 256 * MIB},
        {"headroom": 0.1},
        {"max_batch": 64},
        {"granularity": 8},
        {"target": "cnn"},
    ]
    keys = {key(**change) for change in changes}
    assert base not in keys
    assert len(keys) == len(changes)


def test_examples_fit_batch_eight_in_256_mib() -> None:
    for name in EXAMPLES:
        runner = TrialRunner(EXAMPLES[name](), BudgetDevice(256 * MIB), steps=2)
        assert runner(8).fits, name


def test_a_model_larger_than_the_budget_is_nothing_fits() -> None:
    with pytest.raises(NothingFitsError, match=r"the model alone does not fit within a limit of 3\.8 MiB"):
        run_probe(ProbeRequest(target="gpt", device="cpu", memory=4 * MIB))


def test_prefetch_lowers_the_answer_by_what_it_holds() -> None:
    plain = run_probe(ProbeRequest(target="cnn", device="cpu", memory=64 * MIB, headroom=0))
    held = run_probe(ProbeRequest(target="cnn", device="cpu", memory=64 * MIB, headroom=0, prefetch=8))
    assert held.max_micro_batch < plain.max_micro_batch
    assert held.loop.prefetch == 8 and all(t.prefetch == 8 for t in held.trials)
    assert held.fingerprint != plain.fingerprint
    # 8 held batches of 13 images (640 KiB each) take a sample or more off the answer.
    at = next(t for t in held.loop_trials() if t.batch == held.max_micro_batch + 1)
    assert not at.fits


def test_an_accumulating_plan_warns_about_batch_norm_and_only_then() -> None:
    cnn = run_probe(ProbeRequest(target="cnn", device="cpu", memory=64 * MIB, effective_batch=64))
    assert cnn.batch_norm and cnn.plan is not None and cnn.plan.accumulation_steps > 1
    assert any("BatchNorm" in w for w in cnn.plan.warnings)
    # One micro-step: each batch is the effective batch, nothing to warn about.
    one_step = cnn.make_plan(cnn.max_micro_batch)
    assert one_step.accumulation_steps == 1 and not any("BatchNorm" in w for w in one_step.warnings)
    mlp = run_probe(ProbeRequest(target="mlp", device="cpu", memory=64 * MIB, effective_batch=1000))
    assert not mlp.batch_norm and mlp.plan is not None and mlp.plan.accumulation_steps > 1
    assert not any("BatchNorm" in w for w in mlp.plan.warnings)
