"""The Hugging Face Trainer, tuned by autotune and then run for real on the budget device.

A tiny GPT-2 built from its config, synthetic token sequences of unequal lengths padded by the
collator. What the tests hold autotune to: the values it sets run the Trainer's own `train()` under
the probe's limit, and the same loop with one more sample per micro-batch runs out of memory.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autotune.devices.budget import BudgetDevice  # noqa: E402
from autotune.integrations.transformers import tune_trainer  # noqa: E402
from autotune.units import parse_size  # noqa: E402

MEMORY = "8MiB"
SEQ_MAX = 48
WORST = 5  # the longest example's index


def collate(examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Pads to the longest example, as Hugging Face's padding collators do; padding is not learned."""
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    labels = torch.full((len(examples), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(examples), longest, dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        ids[row, :n] = torch.tensor(example["input_ids"])
        labels[row, :n] = ids[row, :n]
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def examples(count: int, *, all_longest: bool = False) -> list[dict[str, list[int]]]:
    generator = torch.Generator().manual_seed(0)
    made = []
    for i in range(count):
        n = SEQ_MAX if all_longest or i == WORST else int(torch.randint(8, SEQ_MAX - 8, (1,), generator=generator))
        made.append({"input_ids": torch.randint(0, 128, (n,), generator=generator).tolist()})
    return made


def make_trainer(tmp_path: Any, data: list[dict[str, list[int]]], **args: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        **args,
    )
    return transformers.Trainer(model=model, args=arguments, train_dataset=data, data_collator=collate)


def train_under_limit(trainer: Any, micro: int, accumulation: int, max_steps: int) -> bool:
    """The Trainer's own loop at (micro, accumulation) under the probe's limit: True if it fits."""
    trainer.args.per_device_train_batch_size = micro
    trainer.args.gradient_accumulation_steps = accumulation
    trainer.args.max_steps = max_steps
    trainer._train_batch_size = micro
    trainer.optimizer = trainer.lr_scheduler = None
    device = BudgetDevice(parse_size(MEMORY))
    try:
        with device.active():
            trainer.train()
    except torch.OutOfMemoryError:
        return False
    finally:
        trainer.accelerator.free_memory()
    assert trainer.state.global_step == max_steps
    return True


@pytest.fixture(autouse=True)
def _quiet_transformers() -> None:
    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    trainer = make_trainer(tmp_path_factory.mktemp("trainer"), examples(64))
    result = tune_trainer(trainer, effective_batch=48, memory=MEMORY, headroom=0)
    return trainer, result


def test_the_trainer_gets_a_plan_verified_in_its_own_loop(tuned: tuple[Any, Any]) -> None:
    trainer, result = tuned
    plan = result.plan
    assert plan is not None and plan.accumulation_steps > 1, plan
    assert trainer.args.per_device_train_batch_size == plan.micro_batch
    assert trainer.args.gradient_accumulation_steps == plan.accumulation_steps
    assert plan.micro_batch * plan.accumulation_steps == 48
    # The plan's loop was searched itself: the Trainer holds a window's micro-batches at once.
    assert result.loop.micro_steps == plan.accumulation_steps
    assert result.confirmation.status == "skipped" and "live objects" in result.confirmation.note
    assert trainer.autotune_result is result


def test_the_result_names_the_longest_example_and_its_padded_shape(tuned: tuple[Any, Any]) -> None:
    _trainer, result = tuned
    spec = result.workload.input_spec
    assert spec["worst_samples"] == str(WORST)
    assert spec["scanned"] == 64
    assert spec["input_ids"] == f"1x{SEQ_MAX}"
    assert result.workload.optimizer == "trainer:adamw_torch_fused"


def test_tuned_values_run_the_trainer_and_one_more_sample_runs_out(tuned: tuple[Any, Any], tmp_path: Any) -> None:
    trainer, result = tuned
    plan = result.plan
    # The job's own data, variable lengths: at least 3 optimizer steps under the limit.
    assert train_under_limit(trainer, plan.micro_batch, plan.accumulation_steps, max_steps=3)
    # Exact in the Trainer's loop: on worst-case batches, the answer fits and one more does not.
    worst = make_trainer(tmp_path, examples(64, all_longest=True))
    assert train_under_limit(worst, result.max_micro_batch, plan.accumulation_steps, max_steps=3)
    assert not train_under_limit(worst, result.max_micro_batch + 1, plan.accumulation_steps, max_steps=3)


def test_activation_checkpointing_set_in_the_arguments_is_probed(tmp_path: Any) -> None:
    """The trials are the Trainer's train(), which turns checkpointing on: activations are not all
    kept for backward, so more samples fit."""
    answers = []
    for checkpointing in (False, True):
        trainer = make_trainer(tmp_path / str(checkpointing), examples(16), activation_checkpointing=checkpointing)
        tune_trainer(trainer, "max", memory=MEMORY, headroom=0)
        answers.append(trainer.args.per_device_train_batch_size)
        assert trainer.args.gradient_accumulation_steps == 1
    assert answers[1] > answers[0], answers


def test_an_optimizer_and_scheduler_given_to_the_trainer_are_never_stepped(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, examples(16))
    optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    trainer.optimizer, trainer.lr_scheduler = optimizer, scheduler
    before = [p.detach().clone() for p in trainer.model.parameters()]
    result = tune_trainer(trainer, memory=MEMORY, headroom=0)
    assert result.workload.optimizer == "AdamW"
    assert optimizer.state == {} and scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 1e-3
    assert trainer.optimizer is optimizer and trainer.lr_scheduler is scheduler
    assert all(torch.equal(p, b) for p, b in zip(trainer.model.parameters(), before, strict=True))
