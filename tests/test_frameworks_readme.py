"""docs/frameworks.md's framework examples: each block is the autotune code of a script in examples/, at most
three lines of it, and the script runs (on the CPU budget device, as a user without a GPU would)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_text import page, section

ROOT = Path(__file__).resolve().parent.parent
TEXT = page("docs/frameworks.md")
# (script, what the framework needs, its budget, what its last line prints)
EXAMPLES = {
    "examples/trainer_autotune.py": ("transformers", "8MiB", r"\[8, 8, 8, 8, 8, 8, 8, 8\] 3"),
    "examples/lightning_autotune.py": ("lightning", "2MiB", r"\d+ \d+ 3"),
    "examples/accelerate_autotune.py": ("accelerate", "2MiB", r"\d+ [2-9]\d* \d+"),
    "examples/live_workload.py": ("torch", "2MiB", r"\d+ \[\d+, \d+\] \d+"),
}


def _blocks_for(script: str) -> list[str]:
    """The python blocks that follow the paragraph naming `script`, up to the next script's."""
    text = TEXT
    start = text.index(f"(`{script}`)")
    following = [text.find(f"(`{other}`)", start + 1) for other in EXAMPLES if other != script]
    end = min([i for i in following if i > start] or [len(text)])
    return re.findall(r"```python\n(.*?)```", text[start:end], re.S)


@pytest.mark.parametrize("script", list(EXAMPLES))
def test_each_docs_block_is_three_autotune_lines_of_its_script(script: str) -> None:
    blocks = _blocks_for(script)
    assert blocks, f"docs/frameworks.md shows no code for {script}"
    code = (ROOT / script).read_text(encoding="utf-8")
    lines = [line for line in blocks[0].splitlines() if line.strip()]
    assert len(lines) <= 3, lines
    for line in lines:
        assert line in code.splitlines(), f"{line!r} is not in {script}"


@pytest.mark.parametrize("script", list(EXAMPLES))
def test_each_framework_example_runs(script: str) -> None:
    needs, memory, printed = EXAMPLES[script]
    pytest.importorskip(needs)
    env = {**os.environ, "AUTOTUNE_CPU_MEMORY": memory, "AUTOTUNE_HEADROOM": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.fullmatch(printed, done.stdout.strip().splitlines()[-1]), done.stdout[-500:]


# docs/frameworks.md's "Kept, refused, checked": each line (its bold lead) -> the tests that run it.
CLAIMS_RUN_BY = {
    "The job's effective batch.": [
        "tests/test_integration_transformers.py::test_no_effective_batch_keeps_the_jobs_8_x_4",
        "tests/test_integration_lightning.py::test_no_effective_batch_keeps_the_jobs_8_x_4",
        "tests/test_integration_accelerate.py::test_no_effective_batch_keeps_the_jobs_64_x_16",
        "tests/test_frameworks_readme.py::test_each_framework_example_runs",
    ],
    "The largest micro-batch, only when asked.": [
        "tests/test_integration_transformers.py::test_max_asks_for_the_largest_micro_batch_without_accumulation",
        "tests/test_integration_transformers.py::test_activation_checkpointing_set_in_the_arguments_is_probed",
    ],
    "The process as it was.": [
        "tests/test_integration_side_effects.py::test_torch_cpu_random_state",
        "tests/test_integration_side_effects.py::test_torch_cuda_random_states",
        "tests/test_integration_side_effects.py::test_numpy_random_state",
        "tests/test_integration_side_effects.py::test_python_random_state",
        "tests/test_integration_side_effects.py::test_every_modules_train_or_eval_mode",
        "tests/test_integration_side_effects.py::test_the_models_device",
        "tests/test_integration_side_effects.py::test_the_models_weights_and_buffers",
    ],
    "`tune_accelerator` after `accelerator.prepare`.": [
        "tests/test_integration_accelerate.py::test_tuning_after_prepare_is_refused",
    ],
    "Accelerate with a Dataset and no `effective_batch`.": [
        "tests/test_integration_accelerate.py::test_a_dataset_without_effective_batch_is_refused_with_the_fix",
    ],
    "A Lightning accumulation schedule.": [
        "tests/test_integration_lightning.py::test_an_accumulation_schedule_is_refused",
    ],
    "A loader that ignores the batch size autotune sets.": [
        "tests/test_integration_transformers.py::test_a_loader_that_ignores_the_batch_size_is_refused",
        "tests/test_integration_lightning.py::test_a_loader_that_ignores_the_batch_size_attribute_is_refused",
        "tests/test_integration_loader_batch.py::test_lightning_a_loader_that_keeps_its_batch_size_is_refused_before_the_fit",
        "tests/test_integration_loader_batch.py::test_lightning_a_loader_that_reads_the_attribute_runs_the_effective_batch_reported",
        "tests/test_integration_loader_batch.py::test_accelerate_a_batch_sampler_loader_is_refused_and_its_fix_runs_the_effective_batch",
        "tests/test_integration_loader_batch.py::test_accelerate_a_batch_sampler_of_the_plans_size_runs_as_it_is",
        "tests/test_integration_loader_batch.py::test_trainer_a_loader_that_keeps_its_batch_size_is_refused_before_the_probe",
    ],
    "Gradient equivalence.": [
        "tests/test_integration_transformers.py::test_a_bert_style_head_is_warned_with_the_factor_measured",
        "tests/test_integration_transformers.py::test_the_fix_the_warning_names_makes_the_window_the_batch",
        "tests/test_integration_transformers.py::test_the_gradient_check_passes_a_gpt2_head",
        "tests/test_integration_lightning.py::test_a_summed_loss_is_warned_with_the_factor_and_a_mean_is_not",
        "tests/test_integration_accelerate.py::test_a_summed_loss_is_warned_with_the_factor",
        "tests/test_gradient_check_samples.py::test_accelerate_a_token_mean_loss_is_warned_and_a_sample_mean_is_not",
        "tests/test_gradient_check_samples.py::test_lightning_a_token_mean_loss_is_warned_and_a_sample_mean_is_not",
        "tests/test_gradient_check_samples.py::test_trainer_a_token_mean_loss_is_warned_and_num_items_in_batch_is_not",
        "tests/test_gradient_check_samples.py::test_the_docs_trainer_case_passes_the_check",
    ],
    "Progress.": [
        "tests/test_integration_transformers.py::test_every_trial_is_logged_in_the_clis_words_and_the_plan_with_its_warning",
        "tests/test_integration_accelerate.py::test_a_summed_loss_is_warned_with_the_factor",
        "tests/test_gradient_check_samples.py::test_accelerate_a_token_mean_loss_is_warned_and_a_sample_mean_is_not",
        "tests/test_gradient_check_samples.py::test_lightning_a_token_mean_loss_is_warned_and_a_sample_mean_is_not",
        "tests/test_gradient_check_samples.py::test_trainer_a_token_mean_loss_is_warned_and_num_items_in_batch_is_not",
        "tests/test_gradient_check_samples.py::test_the_docs_trainer_case_passes_the_check",
    ],
    "Cost.": [
        "tests/test_integration_transformers.py::test_the_trainer_gets_a_plan_verified_in_its_own_loop",
        "tests/test_integration_lightning.py::test_no_effective_batch_keeps_the_jobs_8_x_4",
        "tests/test_integration_accelerate.py::test_no_effective_batch_keeps_the_jobs_64_x_16",
    ],
}


def test_every_kept_refused_and_checked_line_is_run_by_a_named_test() -> None:
    text = section("docs/frameworks.md", "Kept, refused, checked")
    leads = re.findall(r"^- \*\*(.+?)\*\*", text, re.M)
    assert leads == list(CLAIMS_RUN_BY), "docs/frameworks.md's lines and CLAIMS_RUN_BY differ: name each line's tests"
    for lead, tests in CLAIMS_RUN_BY.items():
        assert tests, lead
        for test in tests:
            path, name = test.split("::")
            assert f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), f"{lead}: {test} does not exist"


# docs/frameworks.md's "Errors and batches": each line (its bold lead) -> the tests that run it.
ERRORS_AND_BATCHES_RUN_BY = {
    "Your code's error, as your code raised it.": [
        "tests/test_integration_errors.py::test_a_key_error_in_the_users_forward_prints_their_frames_in_at_most_15_lines",
        "tests/test_integration_errors.py::test_autotune_debug_keeps_every_frame",
    ],
    "autotune's own errors, short.": [
        "tests/test_integration_errors.py::test_autotunes_own_error_keeps_no_frame_of_autotunes_internals",
    ],
    "Collate errors name the sample, the field and the collate function.": [
        "tests/test_worstcase.py::test_a_sample_the_collate_function_rejects_is_named_with_the_collate_functions_place",
        "tests/test_worstcase.py::test_a_field_the_collate_function_asks_for_and_the_sample_lacks_is_named",
        "tests/test_worstcase.py::test_samples_that_torchs_default_collate_cannot_stack_name_the_field_and_collate",
    ],
    "A missing `collate=`.": [
        "tests/test_integration_errors.py::test_a_dataset_without_collate_names_the_missing_collate_argument",
    ],
    "The worst batch, per dimension.": [
        "tests/test_live_batches.py::test_a_vit_over_images_of_both_orientations_answers_a_size_that_fits_its_real_padded_batches",
        "tests/test_worstcase.py::test_images_of_both_orientations_pad_to_the_tallest_and_the_widest",
        "tests/test_worstcase.py::test_two_padded_fields_keep_each_dimensions_leader_and_the_smaller_batches_their_largest_subset",
    ],
    "The device holds the batch, not its samples.": [
        "tests/test_live_batches.py::test_the_budget_device_holds_the_batch_not_the_samples_it_was_collated_from",
        "tests/test_live_batches.py::test_a_live_padded_sequence_probe_is_predicted_and_counts_what_a_module_workload_counts",
    ],
    "Predicted as module workloads are.": [
        "tests/test_live_batches.py::test_a_live_padded_sequence_probe_is_predicted_and_counts_what_a_module_workload_counts",
        "tests/test_live_batches.py::test_a_vit_over_images_of_both_orientations_answers_a_size_that_fits_its_real_padded_batches",
        "tests/test_predict.py::test_op_sequences_that_always_differ_fall_back_to_the_plain_search",
    ],
    "Fields by their keys.": [
        "tests/test_live_batches.py::test_one_batch_of_a_dict_names_its_fields_by_their_keys",
    ],
}


def test_every_errors_and_batches_line_is_run_by_a_named_test() -> None:
    text = section("docs/frameworks.md", "Errors and batches")
    leads = re.findall(r"^- \*\*(.+?)\*\*", text, re.M)
    assert leads == list(ERRORS_AND_BATCHES_RUN_BY), "name each line's tests in ERRORS_AND_BATCHES_RUN_BY"
    for lead, tests in ERRORS_AND_BATCHES_RUN_BY.items():
        assert tests, lead
        for test in tests:
            path, name = test.split("::")
            assert f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), f"{lead}: {test} does not exist"


def test_the_errors_traceback_shown_is_the_one_tests_check() -> None:
    """The printed traceback of docs/frameworks.md: its shape is the one the tests hold each
    integration to (the user's script first, one frame of autotune's, at most 15 lines)."""
    (shown,) = re.findall(r"```text\n(.*?)```", section("docs/frameworks.md", "Errors and batches"), re.S)
    lines = shown.splitlines()
    assert len(lines) <= 15 and lines[0] == "Traceback (most recent call last):"
    assert lines[1].startswith('  File "train.py"') and lines[-2] == "KeyError: 'features'"
    code = (ROOT / "autotune/integrations/reporting.py").read_text(encoding="utf-8").splitlines()
    raised = max(n for n, line in enumerate(code, 1) if line.strip() == "raise failure from failure.__cause__")
    assert [line for line in lines if "autotune/" in line] == [
        f'  File ".../autotune/integrations/reporting.py", line {raised}, in tune_accelerator'
    ]
    assert re.fullmatch(r"autotune: batch \d+ failed with an error that is not out-of-memory: KeyError: 'features' "
                        r"\(at train\.py:\d+ in forward\)", lines[-1])  # fmt: skip
