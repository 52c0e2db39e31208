"""Request keys and the workload registry: what decides which stored result answers a query,
and which workloads a request may name."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.engine.probe import ProbeRequest, run_probe
from autotune.errors import ConfigError
from autotune.workloads.probekey import DeviceKey, key_for_request, key_from_result, result_model_problems
from autotune.workloads.registry import Registry, UnknownWorkloadError, load_registry
from tests.serving import WORKLOADS_TOML, make_result

MiB = 2**20


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Registry:
    path = tmp_path_factory.mktemp("registry") / "workloads.toml"
    path.write_text(WORKLOADS_TOML)
    return load_registry(path)


def _cpu(size: int = 4 * MiB) -> DeviceKey:
    return DeviceKey(kind="cpu-budget", total_bytes=size)


def test_a_real_probe_result_has_the_key_its_request_had(registry: Registry) -> None:
    entry = registry.get("tiny")
    key = key_for_request(entry, _cpu(), budget="total", memory=None, headroom=0.05)
    request = ProbeRequest(
        target=entry.target,
        options=entry.options,
        device="cpu",
        memory=4 * MiB,
        budget="total",
        headroom=0.05,
        precision=key.precision,  # type: ignore[arg-type]
        optimizer=key.optimizer,  # type: ignore[arg-type]
        steps=key.steps,
        max_batch=key.max_batch,
        granularity=key.granularity,
    )
    result = run_probe(request)
    derived = key_from_result(result, entry)
    assert derived == key
    assert derived is not None
    assert derived.digest() == key.digest()
    # The service can tell it was probed from the registered model: nothing to refuse.
    assert result_model_problems(result, entry) == []


def test_the_key_depends_on_the_limit_not_on_how_the_headroom_was_written(registry: Registry) -> None:
    entry = registry.get("tiny")
    keys = {
        key_for_request(entry, _cpu(), budget="total", memory=None, headroom=headroom).digest()
        for headroom in (0.05, int(4 * MiB * 0.05))
    }
    assert len(keys) == 1
    other = key_for_request(entry, _cpu(), budget="total", memory=None, headroom=0.1)
    assert other.digest() not in keys


def test_everything_that_changes_the_answer_changes_the_key(registry: Registry) -> None:
    entry = registry.get("tiny")
    base = key_for_request(entry, _cpu(), budget="total", memory=None, headroom=0.05)
    variants = [
        key_for_request(registry.get("mlp"), _cpu(), budget="total", memory=None, headroom=0.05),
        key_for_request(entry, _cpu(8 * MiB), budget="total", memory=None, headroom=0.05),
        key_for_request(entry, _cpu(), budget="total", memory=None, headroom=0.05, precision="bf16"),
        key_for_request(entry, _cpu(), budget="total", memory=None, headroom=0.05, optimizer="sgd"),
        key_for_request(entry, _cpu(), budget="total", memory=None, headroom=0.05, steps=3),
        key_for_request(entry, _cpu(), budget="total", memory=None, headroom=0.05, max_batch=32),
        key_for_request(entry, _cpu(), budget="total", memory=None, headroom=0.05, granularity=8),
        key_for_request(
            entry, DeviceKey(kind="cuda", name="GPU", total_bytes=4 * MiB), budget="total", memory=None, headroom=0.05
        ),
    ]
    digests = {v.digest() for v in variants}
    assert base.digest() not in digests
    assert len(digests) == len(variants)
    same = key_for_request(entry, _cpu(), budget="free", memory=None, headroom=0.05, optimizer="ADAMW")
    assert same.digest() == base.digest()  # the budget device has no free memory; optimizer names ignore case


def test_a_gpu_budget_of_total_or_memory_gives_the_same_limit(registry: Registry) -> None:
    entry = registry.get("tiny")
    gpu = DeviceKey(kind="cuda", name="NVIDIA H100 80GB HBM3", total_bytes=80 * 2**30)
    total = key_for_request(entry, gpu, budget="total", memory=None, headroom=0.05)
    asked = key_for_request(entry, gpu, budget="total", memory=80 * 2**30, headroom=0.05)
    assert total.digest() == asked.digest()
    free = key_for_request(entry, gpu, budget="free", memory=None, headroom=0.05)
    assert free.limit_bytes is None
    assert free.digest() != total.digest()


def test_impossible_budgets_are_config_errors(registry: Registry) -> None:
    entry = registry.get("tiny")
    gpu = DeviceKey(kind="cuda", name="GPU", total_bytes=10 * 2**30)
    with pytest.raises(ConfigError, match="more than the device has"):
        key_for_request(entry, gpu, budget="total", memory=20 * 2**30, headroom=0.05)
    with pytest.raises(ConfigError, match="leaves nothing"):
        key_for_request(entry, _cpu(), budget="total", memory=None, headroom=8 * MiB)


def test_a_free_memory_result_answers_no_key(registry: Registry) -> None:
    entry = registry.get("tiny")
    assert key_from_result(make_result(budget_policy="free"), entry) is None
    assert key_from_result(make_result(), entry) is not None
    with pytest.raises(ValueError, match="not for the registered"):
        key_from_result(make_result(), registry.get("mlp"))


def test_the_registry_has_the_builtins_and_the_files_entries(registry: Registry) -> None:
    assert {"mlp", "cnn", "gpt", "tiny", "nofit"} <= set(registry.names())
    tiny = registry.get("tiny")
    assert (tiny.precision, tiny.optimizer, tiny.max_batch) == ("fp32", "adamw", 16)
    assert registry.find("mlp", {"in_features": 64, "hidden": 64, "layers": 1, "classes": 10}) == tiny
    assert registry.find("mlp", {"in_features": 65}) is None
    with pytest.raises(UnknownWorkloadError, match="not registered"):
        registry.get("nope")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not toml [", "not valid TOML"),
        ("colour = 1", "unknown top-level key"),
        ("builtins = 'yes'", "builtins must be true or false"),
        ("builtins = false", "no workloads registered"),
        ("[workloads.x]\noptions = {}", "target"),
        ("[workloads.x]\ntarget = 'mlp'\ntypo = 1", "typo"),
        ("[workloads.x]\ntarget = 'mlp'\noptions = { nope = 1 }", "bad options"),
        ("[workloads.x]\ntarget = 'resnet'", "unknown workload 'resnet'"),
        ("[workloads.x]\ntarget = 'no_such_module_here:w'", "cannot import module"),
        ("[workloads.'bad name']\ntarget = 'mlp'", "is not allowed"),
        ("[workloads.x]\ntarget = 'mlp'\nmax_batch = 0", "max_batch"),
    ],
)
def test_a_bad_workloads_file_names_the_file_and_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "workloads.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_registry(path)
    assert str(path) in str(info.value)


def test_a_missing_workloads_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_registry(tmp_path / "missing.toml")


def test_a_file_can_drop_the_builtins_and_override_a_name(tmp_path: Path) -> None:
    path = tmp_path / "workloads.toml"
    path.write_text("builtins = false\n[workloads.gpt]\ntarget = 'gpt'\noptions = { layers = 1 }\n")
    registry = load_registry(path)
    assert registry.names() == ["gpt"]
    assert registry.get("gpt").options == {"layers": 1}
