"""A card profile (`card="h100"`): the budget device standing for that GPU, with its fraction cap as CUDA
computes it, the memory outside PyTorch and cuBLAS's workspaces (issue 37)."""

from __future__ import annotations

import pytest
import torch

from autotune.devices.allocator import AllocatorConfig, CachingAllocatorModel
from autotune.devices.budget import BudgetDevice
from autotune.devices.cards import CARDS
from autotune.engine.trial import TrialRunner
from autotune.errors import ConfigError
from autotune.workloads.workload import Workload

H100 = CARDS["h100"]
MIB = 1 << 20


@pytest.mark.parametrize("limit", [512 * MIB, 2 << 30, 80_766_618_829])
def test_the_cap_is_cudas_to_the_byte(limit: int) -> None:
    # torch.cuda.set_per_process_memory_fraction(limit / total): CUDA allows size_t(fraction * total),
    # in doubles, which at 2 GiB of an H100 is a byte below the limit (the records' 137 samples).
    cap = int(limit / H100.total_bytes * H100.total_bytes)
    model = BudgetDevice(limit, card="h100")._counter.allocator
    assert model is not None and model._allowed == cap
    if limit == 2 << 30:
        assert cap == limit - 1
    # Without the card the model's cap is the limit itself: a byte more room at 2 GiB.
    assert CachingAllocatorModel(limit)._allowed == limit


def test_memory_outside_pytorch_is_out_of_cudamallocs_reach() -> None:
    # The whole card with no headroom: the cap allows all of it, the context keeps 738 MiB.
    model = CachingAllocatorModel(
        H100.total_bytes, AllocatorConfig(), total_bytes=H100.total_bytes, outside_bytes=H100.outside_bytes
    )
    reachable = H100.total_bytes - H100.outside_bytes
    model.malloc(reachable // (2 * MIB) * 2 * MIB - 2 * MIB)  # fits (large segments round up to 2 MiB)
    with pytest.raises(Exception, match="CUDA out of memory"):
        model.malloc(4 * MIB)


def _mlp() -> Workload:
    return Workload(
        name="mlp",
        build_model=lambda: torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)),
        make_batch=lambda b, device: torch.randn(b, 64, device=device),
        loss=lambda model, x: model(x).square().mean(),
        optimizer="sgd",
    )


def test_cublas_workspaces_are_allocated_by_the_forward_and_the_backward_and_freed_between_trials() -> None:
    plain = TrialRunner(_mlp(), BudgetDevice(512 * MIB, allocator="cuda"))
    card = TrialRunner(_mlp(), BudgetDevice(512 * MIB, card="h100"))
    without, with_card = plain(4), card(4)
    # Two handles (the forward's thread, autograd's), a workspace each, alive at the peak in backward.
    assert with_card.peak_allocated_bytes - without.peak_allocated_bytes == 2 * H100.cublas_workspace_bytes
    assert card.device.live_bytes() == card.baseline_bytes  # cleared with the cache, as on CUDA
    assert card(4).peak_allocated_bytes == with_card.peak_allocated_bytes  # and allocated again by the next


def test_what_the_model_does_not_follow_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="garbage_collection_threshold, which the budget device's model does not"):
        BudgetDevice(512 * MIB, allocator="cuda", allocator_config="garbage_collection_threshold:0.6")
    with pytest.raises(ConfigError, match="is more than an NVIDIA H100 80GB HBM3 has"):
        BudgetDevice(100 << 30, card="h100")
    with pytest.raises(ConfigError, match="no card profile 'a100'"):
        BudgetDevice(512 * MIB, card="a100")
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    with pytest.raises(ConfigError, match="PYTORCH_NO_CUDA_MEMORY_CACHING is set"):
        BudgetDevice(512 * MIB, allocator="cuda")
    from autotune.devices.cuda import refuse_uncached

    with pytest.raises(ConfigError, match="PYTORCH_NO_CUDA_MEMORY_CACHING is set: it turns CUDA's caching allocator"):
        refuse_uncached()


def test_the_cli_probes_through_a_card_and_refuses_what_cannot_stand_for_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from autotune import cli
    from tests.serving import ROOT

    monkeypatch.chdir(ROOT)
    code = cli.run(
        [
            "probe",
            "tests.workloads:tiny",
            "--device",
            "cpu",
            "--memory",
            "80MiB",
            "--max-batch",
            "64",
            "--card",
            "h100",
            "--json",
        ]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.err
    result = json.loads(printed.out)
    assert result["device"]["name"] == "CPU budget device (80.0 MiB) standing for an NVIDIA H100 80GB HBM3"
    assert "2 cuBLAS workspaces of 32.0 MiB; 738.0 MiB outside PyTorch" in result["allocator_config"]
    assert all(t["peak_allocated_bytes"] >= 2 * H100.cublas_workspace_bytes for t in result["trials"] if t["fits"])
    for flags, words in (
        (["--card", "a100"], "--card 'a100' is not one of h100"),
        (["--card", "h100", "--allocator", "exact"], "drop --allocator exact (a card implies --allocator cuda)"),
    ):
        assert cli.run(["probe", "mlp", "--device", "cpu", *flags]) == 2
        assert words in capsys.readouterr().err
