"""Live probes' batches as the job's loader makes them (issue 24, items 7 and 8): padded in every
dimension to the worst samples of each (images of both orientations pad to the tallest and the
widest), collated on the host and copied to the device, so that the device counts the batch only and
the predictor sees the model's step only."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from autotune import Workload, probe_workload
from autotune.devices.budget import BudgetDevice
from autotune.units import parse_size
from autotune.workloads import worstcase

PATCH = 8
# Index -> (height, width): the largest image (wide), the tallest (portrait) and another wide one;
# the others are small. No image is 64x64, and the job's worst padded batch is.
SIZES = {3: (56, 64), 11: (64, 48), 17: (40, 64)}
TALLEST, LARGEST = 11, 3
VIT_MEMORY = "8MiB"


class Images(Dataset[tuple[torch.Tensor, int]]):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        height, width = SIZES.get(i, (32 + 8 * (i % 3), 40 - 8 * (i % 2)))
        return torch.randn(3, height, width, generator=torch.Generator().manual_seed(i)), i % 10


def pad_images(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The job's collate: every image padded to the tallest and the widest of its batch."""
    height = max(image.shape[1] for image, _ in samples)
    width = max(image.shape[2] for image, _ in samples)
    images = torch.zeros(len(samples), 3, height, width)
    for row, (image, _) in enumerate(samples):
        images[row, :, : image.shape[1], : image.shape[2]] = image
    return images, torch.tensor([label for _, label in samples])


class ViT(nn.Module):
    """Patches of 8x8 pixels, one encoder layer: memory grows with the padded image's area."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv2d(3, dim, PATCH, stride=PATCH)
        self.encoder = nn.TransformerEncoderLayer(dim, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(images).flatten(2).transpose(1, 2)
        return self.head(self.encoder(tokens).mean(1))


def image_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    images, labels = batch
    return nn.functional.cross_entropy(model(images), labels)


def real_loop_fits(micro: int, rows: list[int], memory: str, steps: int = 3) -> bool:
    """The job's own loop (its DataLoader and collate, AdamW) for `steps` optimizer steps, each on
    the batch of `rows` padded by the job's collate, under the probe's limit: True if it fits."""
    model = ViT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Images(), batch_sampler=[rows[:micro]] * steps, collate_fn=pad_images)
    device = BudgetDevice(parse_size(memory))
    device.track([*model.parameters(), *model.buffers()])
    try:
        with device.active():
            for batch in loader:
                image_loss(model, batch).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    except torch.OutOfMemoryError:
        return False
    return True


def test_a_vit_over_images_of_both_orientations_answers_a_size_that_fits_its_real_padded_batches() -> None:
    """The scan once kept the largest image alone (56x64): the probe answered 56 here, and the job's
    batches padded to 64x64 (the tallest and the widest in one batch) ran out of memory at 56."""
    loader = DataLoader(Images(), batch_size=4, collate_fn=pad_images)
    workload = Workload.from_model(ViT(), batch=loader, loss=image_loss, optimizer=torch.optim.AdamW)
    result = probe_workload(workload, memory=VIT_MEMORY, headroom=0)

    spec = result.workload.input_spec
    assert spec["worst_samples"] == f"{LARGEST},{TALLEST}"
    assert spec["0"] == "2x3x64x64"  # the worst samples padded together, as the loader pads them
    answer = result.max_micro_batch_without_accumulation
    assert answer is not None
    # The job's worst batch: the tallest and the widest image among others, padded to 64x64.
    worst_rows = [TALLEST, LARGEST, *(i for i in range(len(Images())) if i not in (TALLEST, LARGEST))] * 4
    assert real_loop_fits(answer, worst_rows, VIT_MEMORY)
    assert not real_loop_fits(answer + 1, worst_rows, VIT_MEMORY)  # and exact: one more does not
    # Predicted from its timeline trials (the collate's ops are the host's): at most 4 trials a loop.
    assert_predicted(result)


def assert_predicted(result: Any) -> None:
    """One micro-step's loop predicted exactly from its timeline trials; every loop in at most 4
    trials (the accumulating loop starts from the first loop's answer, and predicts below it)."""
    first = result.answers[0]
    assert first.loop.micro_steps == 1
    assert first.prediction is not None and first.prediction.fallback_reason is None and first.prediction.exact
    for answer in result.answers:
        assert answer.prediction is None or answer.prediction.fallback_reason is None
        assert len(result.loop_trials(answer.loop.micro_steps)) <= 4, result.loop_trials(answer.loop.micro_steps)


# Padded sequences ---------------------------------------------------------------------------------
class Sequences(Dataset[dict[str, torch.Tensor]]):
    """Token sequences of 8 to 37 tokens; sample 5 is the longest (48)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        length = 48 if i == 5 else 8 + (i * 7) % 30
        return {"tokens": torch.randint(0, 100, (length,), generator=torch.Generator().manual_seed(i)),
                "label": torch.tensor(i % 4)}  # fmt: skip


def pad_tokens(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A padding collate whose own ops grow with the rows (one copy per row)."""
    tokens = nn.utils.rnn.pad_sequence([s["tokens"] for s in samples], batch_first=True)
    return {"tokens": tokens, "label": torch.stack([s["label"] for s in samples])}


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 64)
        self.hidden = nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed(tokens))).mean(1))


def token_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["tokens"]), batch["label"])


def test_a_live_padded_sequence_probe_is_predicted_and_counts_what_a_module_workload_counts() -> None:
    """The collate runs 14/24/44 ops at 2/4/8 rows: in the timeline they made every size's op
    sequence differ (a plain search of 14 trials a loop). On the host, the timeline is the
    model's step, each loop is predicted in 4 trials, and the answer is a module workload's that
    makes the same padded batch directly (the samples the batch is collated from are not counted)."""
    live = Workload.from_model(
        Classifier(), batch=Sequences(), collate=pad_tokens, loss=token_loss, optimizer=torch.optim.AdamW
    )
    result = probe_workload(live, memory="4MiB", headroom=0)
    assert_predicted(result)

    def same_batch(size: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {  # the longest sample's shape, every row
            "tokens": torch.randint(0, 100, (size, 48), device=device),
            "label": torch.full((size,), 1, dtype=torch.long, device=device),
        }

    module = Workload(
        name="same", build_model=Classifier, make_batch=same_batch, loss=token_loss, optimizer="adamw",
        optimizer_kwargs={"lr": 1e-3},
    )  # fmt: skip
    direct = probe_workload(module, memory="4MiB", headroom=0)
    assert result.max_micro_batch == direct.max_micro_batch
    assert result.max_micro_batch_without_accumulation == direct.max_micro_batch_without_accumulation
    peaks = {t.batch: t.peak_allocated_bytes for t in result.loop_trials(1)}
    assert peaks == {t.batch: t.peak_allocated_bytes for t in direct.loop_trials(1)}


def test_the_budget_device_holds_the_batch_not_the_samples_it_was_collated_from() -> None:
    """Outside the device's counting (on the host) the collate reads the samples and builds the batch;
    the device's memory is the batch's copy only, as a transfer to a GPU would allocate."""
    make_batch = worstcase.worst_case_maker(Sequences(), pad_tokens)
    device = BudgetDevice(2**30)
    with device.active():
        batch = make_batch(6, device.torch_device)
        held = device.live_bytes()
    assert batch["tokens"].shape == (6, 48)
    assert held == 512 * -(-6 * 48 * 8 // 512) + 512  # the tokens and the labels, in 512-byte blocks


def test_one_batch_of_a_dict_names_its_fields_by_their_keys() -> None:
    batch = {"tokens": torch.randint(0, 100, (4, 16)), "label": torch.zeros(4, dtype=torch.long)}
    workload = Workload.from_model(Classifier(), batch=batch, loss=token_loss)
    assert dict(workload.input_spec) == {"batch": "given, rows repeated", "tokens": "4x16", "label": "4"}
