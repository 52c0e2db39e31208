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
from autotune.errors import ConfigError  # noqa: E402
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
    # Its name in TrainingArguments: gradient_checkpointing before transformers renamed it (5.17 has only that).
    name = next(
        n
        for n in ("activation_checkpointing", "gradient_checkpointing")
        if n in transformers.TrainingArguments.__dataclass_fields__
    )
    for checkpointing in (False, True):
        trainer = make_trainer(tmp_path / str(checkpointing), examples(16), **{name: checkpointing})
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


# The job as configured ------------------------------------------------------------------------
class _Logged(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, _Logged]:
    """A GPT-2 job configured with 8 per device x 4 accumulation steps, tuned with no effective_batch."""
    trainer = make_trainer(
        tmp_path_factory.mktemp("kept"), examples(64), per_device_train_batch_size=8, gradient_accumulation_steps=4
    )
    logged = _Logged()
    logger = logging.getLogger("autotune")
    logger.addHandler(logged)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        result = tune_trainer(trainer, memory=MEMORY, headroom=0)
    finally:
        logger.removeHandler(logged)
        logger.setLevel(level)
    return trainer, result, logged


def test_no_effective_batch_keeps_the_jobs_8_x_4(kept: tuple[Any, Any, _Logged]) -> None:
    trainer, result, logged = kept
    tuning = result.framework
    assert tuning.framework == "transformers" and tuning.effective_batch_from == "job"
    assert (tuning.job.micro_batch, tuning.job.accumulation_steps, tuning.job.effective_batch) == (8, 4, 32)
    assert result.plan.effective_batch == tuning.effective_batch == 32
    args = trainer.args
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 32
    assert (tuning.tuned.micro_batch, tuning.tuned.accumulation_steps) == (
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
    )
    assert "autotune: planning for the job's effective batch 32 (8 per device x 4 accumulation steps x 1 process)" in (
        logged.messages(logging.INFO)
    )
    assert tuning.trials == len(result.trials) and tuning.seconds >= result.duration_seconds > 0


def test_max_asks_for_the_largest_micro_batch_without_accumulation(tmp_path: Any) -> None:
    trainer = make_trainer(tmp_path, examples(16), per_device_train_batch_size=8, gradient_accumulation_steps=4)
    result = tune_trainer(trainer, "max", memory=MEMORY, headroom=0)
    assert result.plan is None and result.framework.effective_batch_from == "max"
    assert trainer.args.gradient_accumulation_steps == 1
    assert trainer.args.per_device_train_batch_size == result.max_micro_batch_without_accumulation


def test_every_trial_is_logged_in_the_clis_words_and_the_plan_with_its_warning(
    kept: tuple[Any, Any, _Logged], monkeypatch: pytest.MonkeyPatch
) -> None:
    from autotune.cli.progress import ProgressView, _Lines

    _trainer, result, logged = kept
    said: list[str] = []
    lines = _Lines(ProgressView("probing"))
    monkeypatch.setattr(lines, "say", said.append)
    for record in result.trials:
        lines.trial(record)
    info = logged.messages(logging.INFO)
    assert [m for m in info if m.startswith("trial ")] == said
    plan = result.plan
    assert any(
        m.startswith(f"autotune: micro-batch {plan.micro_batch} x {plan.accumulation_steps} accumulation steps")
        and f"{len(result.trials)} trials in" in m
        for m in info
    ), info
    # The exact plan's warning: only one micro-batch divides the effective batch below the maximum.
    warning = next(w for w in plan.warnings if "divides 32" in w)
    assert f"autotune: {warning}" in logged.messages(logging.WARNING)


def test_the_gradient_check_passes_a_gpt2_head(kept: tuple[Any, Any, _Logged]) -> None:
    """GPT-2's loss takes num_items_in_batch: the Trainer's window is the batch, and nothing is warned."""
    _trainer, result, _logged = kept
    check = result.framework.gradient_check
    assert check.accumulation_steps == result.plan.accumulation_steps > 1
    assert check.equivalent and check.factor == pytest.approx(1.0, abs=1e-4), check
    assert not [w for w in result.plan.warnings if "gradient" in w]


def bert_collate(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        ids[row, :n] = torch.tensor(example["input_ids"])
        mask[row, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([e["label"] for e in examples])}


def bert_trainer(tmp_path: Any, **args: Any) -> Any:
    """A BERT-style sequence classifier (its forward takes **kwargs, its loss ignores num_items_in_batch)."""
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
    )
    model = transformers.BertForSequenceClassification(config)
    data = [dict(e, label=i % 3) for i, e in enumerate(examples(64))]
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        use_cpu=True, **args,
    )  # fmt: skip
    return transformers.Trainer(model=model, args=arguments, train_dataset=data, data_collator=bert_collate)


# The Trainer's switch for dividing the loss by the steps: transformers 5.17 (the H100 image's) has no
# loss_is_scaled_for_ga, and tune_trainer names the one the installed Trainer has.
SWITCH = (
    "loss_is_scaled_for_ga" if hasattr(transformers.Trainer, "loss_is_scaled_for_ga") else "model_accepts_loss_kwargs"
)


def test_a_bert_style_head_is_warned_with_the_factor_measured(tmp_path: Any) -> None:
    trainer = bert_trainer(tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=8)
    result = tune_trainer(trainer, memory=MEMORY, headroom=0)
    steps = result.plan.accumulation_steps
    assert steps == 8, result.plan
    check = result.framework.gradient_check
    # Every micro-step's mean loss summed, never divided: the window's gradient is `steps` times the batch's.
    assert not check.equivalent and check.factor == pytest.approx(steps, rel=1e-3), check
    warning = next(w for w in result.plan.warnings if "accumulation does not train like the effective batch" in w)
    assert f"gave {check.factor:.2f}x the gradient of one batch of the same" in warning
    assert f"trainer.{SWITCH} = False" in warning and "compute_loss" in warning


def test_the_fix_the_warning_names_makes_the_window_the_batch(tmp_path: Any) -> None:
    trainer = bert_trainer(tmp_path, per_device_train_batch_size=16, gradient_accumulation_steps=8)
    setattr(trainer, SWITCH, False)
    result = tune_trainer(trainer, memory=MEMORY, headroom=0)
    check = result.framework.gradient_check
    assert check.equivalent and check.factor == pytest.approx(1.0, abs=1e-4), check


def test_a_loader_that_ignores_the_batch_size_is_refused(tmp_path: Any) -> None:
    class FixedBatches(transformers.Trainer):
        def get_train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(self.train_dataset, batch_size=16, collate_fn=collate)

    base = make_trainer(tmp_path, examples(16), per_device_train_batch_size=8)
    trainer = FixedBatches(model=base.model, args=base.args, train_dataset=base.train_dataset, data_collator=collate)
    with pytest.raises(ConfigError, match=r"makes batches of 16 while per_device_train_batch_size is 8"):
        tune_trainer(trainer, memory=MEMORY, headroom=0)
