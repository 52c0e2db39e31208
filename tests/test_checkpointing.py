"""Activation checkpointing chosen with the micro-batch (issue 39): the setting, its gradients, the
choice `--checkpointing auto` makes by measured speed, its answers held in an independent loop,
the Trainer's switch, and the service's plan with the client that applies it.

The command line's choice runs at 10 MiB on a small `gpt` (64 wide, 64 tokens: 3 s of trials); the
issue's own command (256 MiB, the default `gpt`) takes about 40 s and is docs/checkpointing.md's
measurement."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import itertools
import json
import shlex
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from torch import nn

from autotune import cli
from autotune.engine import checkpointing as choosing
from autotune.engine.probe import ProbeRequest, run_probe
from autotune.errors import ConfigError, WorkloadError
from autotune.request import checkpointing_candidates
from autotune.results import CheckpointingCandidate
from autotune.workloads import checkpointing, examples, fingerprint
from autotune.workloads.probekey import checkpointing_key
from tests.benches import load_bench
from tests.docs_text import console_commands, section

SMALL = {"width": 64, "layers": 4, "vocab_size": 512, "seq_len": 64}
MEMORY = "10MiB"
FLAGS = [f"{k}={v}" for k, v in SMALL.items()]


def _gradients(model: nn.Module, loss: Any, batch: Any) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss(model, batch).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    ("name", "options"),
    [("gpt", SMALL), ("mlp", {"in_features": 64, "hidden": 64, "layers": 3}), ("cnn", {"image_size": 16})],
)
def test_gradients_are_the_same_with_and_without_checkpointing(name: str, options: dict[str, int]) -> None:
    workload = examples.EXAMPLES[name](**options)
    torch.manual_seed(0)
    model = workload.build_model().eval()  # BatchNorm: the batch's statistics, not a running update
    batch = workload.make_batch(4, torch.device("cpu"))
    plain = _gradients(model, workload.loss, batch)
    for setting in ("full", "every=2"):
        assert checkpointing.apply(model, setting) >= 1
        assert checkpointing.applied(model)
        again = _gradients(model, workload.loss, batch)
        assert len(again) == len(plain)
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(again, plain, strict=True)), setting
    checkpointing.remove(model)
    assert not checkpointing.applied(model) and all("forward" not in m.__dict__ for m in model.modules())


def test_blocks_are_found_named_or_refused_and_settings_read() -> None:
    model = examples.gpt(**SMALL).build_model()
    found = checkpointing.find_blocks(model)
    assert isinstance(found, list) and len(found) == 4 and found[0] is model.blocks[0]
    assert checkpointing.find_blocks(model, "blocks") == found
    assert checkpointing.find_blocks(model, lambda m: [m.blocks[1]]) == [model.blocks[1]]
    # every=K checkpoints blocks K, 2K, ... (counted from 1, as torchtitan counts)
    assert checkpointing.checkpointed_indices(4, "every=2") == [1, 3]
    assert checkpointing.checkpointed_indices(4, "full") == [0, 1, 2, 3]
    assert checkpointing.apply(model, "every=2") == 2
    assert ["forward" in b.__dict__ for b in model.blocks] == [False, True, False, True]
    sequential = checkpointing.find_blocks(examples.mlp().build_model())
    assert isinstance(sequential, tuple) and sequential[1:] == (2, 3)  # (Linear, GELU) three times
    with pytest.raises(WorkloadError, match="no repeated blocks"):
        checkpointing.find_blocks(nn.Linear(2, 2))
    with pytest.raises(WorkloadError, match="has no 'layers'"):
        checkpointing.find_blocks(model, "layers")
    assert checkpointing_candidates("auto") == ["none", "full"]
    assert checkpointing_candidates("full,none,every=2") == ["none", "every=2", "full"]
    assert checkpointing_candidates("every=1") == ["full"]
    assert ProbeRequest(target="gpt", checkpointing="auto").checkpointing == "none,full"
    with pytest.raises(ConfigError, match="not a setting"):
        checkpointing_candidates("sometimes")
    with pytest.raises(WorkloadError, match="not a setting"):
        examples.gpt().with_checkpointing("every=0")
    assert cli.run(["probe", "gpt", "--device", "cpu", "--checkpointing", "every=x"]) == 2


def test_the_setting_is_in_the_fingerprint_and_the_key_and_none_changes_neither() -> None:
    environment = {"steps": 2, "device_kind": "cpu-budget", "device_name": "cpu", "total_bytes": 1, "limit_bytes": 1}
    common = {**environment, "max_batch": None, "granularity": 1, "prefetch": 0}
    versions = {"torch_version": "t", "cuda_version": None, "allocator": None}
    plain = fingerprint.probe_environment(**common, **versions)  # type: ignore[arg-type]
    assert fingerprint.probe_environment(**common, **versions, checkpointing="none") == plain  # type: ignore[arg-type]
    full = fingerprint.probe_environment(**common, **versions, checkpointing="full")  # type: ignore[arg-type]
    assert full == {**plain, "checkpointing": "full"}
    assert checkpointing_key(None) is None and checkpointing_key("none") is None
    assert checkpointing_key("full") == "full"
    assert checkpointing_key("auto", 256, 1, "fewest-steps") != checkpointing_key("auto", 128, 1, "fewest-steps")


def test_ties_go_to_less_checkpointing_and_the_fastest_wins_otherwise() -> None:
    def option(setting: str, speed: float) -> CheckpointingCandidate:
        return CheckpointingCandidate(setting=setting, max_micro_batch=4, samples_per_second=speed, micro_batch=4)

    winner, why = choosing.choose([option("none", 100.0), option("full", 104.0)])
    assert winner.setting == "none" and "a tie, which less checkpointing wins" in why
    winner, why = choosing.choose([option("none", 100.0), option("every=2", 120.0), option("full", 140.0)])
    assert winner.setting == "full" and "40% more samples/s than none" not in why and "fastest" in why


# The command line's choice ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def auto() -> dict[str, Any]:
    """docs/checkpointing.md's `autotune probe gpt ... --checkpointing auto --json`, in this process
    (its probe isolated and confirmed in fresh processes, as always)."""
    (command,) = console_commands(section("docs/checkpointing.md", "Choosing it with the micro-batch"))
    args = shlex.split(command)[1:]
    assert args[:2] == ["probe", "gpt"] and f"--memory {MEMORY}" in command
    assert all(f in command for f in FLAGS) and "--checkpointing auto --json" in command
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.run(args) == 0
    result: dict[str, Any] = json.loads(printed.getvalue())
    return result


def test_auto_lists_none_and_full_with_their_answers_speeds_and_the_chosen_one(auto: dict[str, Any]) -> None:
    choice = auto["checkpointing"]
    by = {c["setting"]: c for c in choice["candidates"]}
    assert list(by) == ["none", "full"]
    assert by["full"]["max_micro_batch"] > by["none"]["max_micro_batch"]
    assert by["full"]["max_micro_batch_without_accumulation"] > by["none"]["max_micro_batch_without_accumulation"]
    assert all(c["samples_per_second"] > 0 and c["plan"] is not None and c["peak_bytes"] for c in by.values())
    chosen = by[choice["chosen"]]
    fastest = max(c["samples_per_second"] for c in by.values())
    assert chosen["samples_per_second"] >= fastest * (1 - choice["tie_tolerance"]), choice["reason"]
    assert choice["chosen"] in choice["reason"] and "samples/s" in choice["reason"]
    # The top-level answers, plan and trials are the chosen setting's, confirmed in fresh processes.
    assert auto["max_micro_batch"] == chosen["max_micro_batch"]
    assert auto["plan"] == chosen["plan"] and auto["trials"] == chosen["trials"]
    assert auto["workload"]["checkpointing"] == (None if choice["chosen"] == "none" else choice["chosen"])
    assert auto["fingerprint"] == chosen["fingerprint"] and by["none"]["fingerprint"] != by["full"]["fingerprint"]
    assert auto["verdict"]["status"] == "confirmed" and auto["confirmation"]["status"] == "passed"
    # A later setting costs no more than the first: its accumulating loop is predicted from the first's.
    trials = [len(c["trials"]) for c in by.values()]
    assert sum(trials) <= 3 * trials[0], trials
    seeded = by["full"]["answers"][1]["prediction"]
    assert seeded["seeded_from"] and "with checkpointing none" in seeded["seeded_from"]


def test_each_setting_s_answer_holds_in_an_independent_loop_and_one_more_runs_out(auto: dict[str, Any]) -> None:
    """bench/cuda_truth.py's plain loop (the model with the setting applied, AdamW, a fresh batch per
    micro-step, 3 accumulated micro-steps or 1), each run on a new budget device at the result's
    limit: the chosen setting's confirmed answers, and the other setting's searched ones."""
    bench = load_bench("cuda_truth")
    for candidate in auto["checkpointing"]["candidates"]:
        setting = candidate["setting"]
        claimed = {
            **auto,
            "max_micro_batch": candidate["max_micro_batch"],
            "max_micro_batch_without_accumulation": candidate["max_micro_batch_without_accumulation"],
            "workload": {**auto["workload"], "checkpointing": None if setting == "none" else setting},
        }
        rows = bench.truth(claimed, "cpu", 3, {}, None, run=lambda job, env: bench.plain_loop(job))
        assert len(rows) == 4
        assert all(r["fits"] == r["expected_fits"] for r in rows), (setting, rows)


# The Hugging Face Trainer ------------------------------------------------------------------------
def test_the_trainer_sets_gradient_checkpointing_when_auto_chooses_it_keeping_the_effective_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    from autotune.integrations.transformers import set_trainer_checkpointing, tune_trainer
    from tests.test_integration_transformers import MEMORY as TRAINER_MEMORY
    from tests.test_integration_transformers import examples as token_examples
    from tests.test_integration_transformers import make_trainer, train_under_limit

    gc.freeze()  # transformers, imported just now, out of the collector's reach (tests/conftest.py's rule)
    trainer = make_trainer(tmp_path, token_examples(64), per_device_train_batch_size=8, gradient_accumulation_steps=6)
    model = trainer.model
    batch = trainer.data_collator(token_examples(4))
    model.train()  # dropout: the same masks in both runs (a checkpoint replays its RNG state when it recomputes)
    torch.manual_seed(1)
    without = _gradients(model, lambda m, b: m(**b).loss, batch)
    set_trainer_checkpointing(trainer, "full")  # the switch tune_trainer sets, as the Trainer's train() applies it
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(1)
    with_checkpointing = _gradients(model, lambda m, b: m(**b).loss, batch)
    assert model.is_activation_checkpointing and trainer.args.activation_checkpointing
    set_trainer_checkpointing(trainer, "none")
    assert not model.is_activation_checkpointing and not trainer.args.activation_checkpointing
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(with_checkpointing, without, strict=True))

    real_choose = choosing.choose

    def full_wins(options: list[CheckpointingCandidate]) -> tuple[CheckpointingCandidate, str]:
        assert [c.setting for c in options] == ["none", "full"] and real_choose(options)
        return next(c for c in options if c.setting == "full"), "full (chosen by the test)"

    monkeypatch.setattr(choosing, "choose", full_wins)
    result = tune_trainer(
        trainer, memory=TRAINER_MEMORY, headroom=0, checkpointing="auto", progress=False, check_gradients=False
    )
    none, full = result.checkpointing.candidates
    assert full.max_micro_batch > none.max_micro_batch  # the Trainer's own switch freed memory
    assert result.workload.checkpointing == "full"
    assert trainer.args.activation_checkpointing is True and trainer.args.gradient_checkpointing is True
    args = trainer.args
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 48  # the job's 8 x 6
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    assert micro > none.max_micro_batch  # a micro-batch that fits only with checkpointing
    assert train_under_limit(trainer, micro, accumulation, max_steps=2)


# The service's plan, and the client that applies it -----------------------------------------------
def test_the_plan_endpoint_says_the_setting_and_the_client_applies_it(tmp_path: Path) -> None:
    from api import create_app, v1
    from autotune.client import AutotuneClient, CheckpointedPlan
    from autotune.settings import Settings

    memory = 10 * 2**20
    workloads = tmp_path / "workloads.toml"
    options = ", ".join(f"{k} = {v}" for k, v in SMALL.items())
    workloads.write_text(f'[workloads.small]\ntarget = "gpt"\noptions = {{ {options} }}\n')
    probed = run_probe(
        ProbeRequest(target="gpt", options=SMALL, device="cpu", memory=memory, headroom=0.05, checkpointing="full")
    )
    assert probed.workload.checkpointing == "full"
    app = create_app(Settings(db=str(tmp_path / "p.db"), workloads=workloads, cpu_memory=memory, token=None))
    v1._QUERIES.clear()

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
                published = await client.post("/v1/results", json=probed.model_dump(mode="json"))
                assert published.status_code == 201, published.text
                query = "/v1/plan?workload=small&effective_batch=256&device=cpu"
                return await client.get(query + "&checkpointing=full"), await client.get(query)

    asked, plain = asyncio.run(scenario())
    assert asked.status_code == 200, asked.text
    view = asked.json()
    assert view["checkpointing"]["setting"] == "full" and view["fingerprint"] == probed.fingerprint
    assert view["max_micro_batch"] == probed.max_micro_batch
    assert plain.status_code == 202 and "checkpointing" not in plain.text  # another key: no stored result

    def service(request: httpx.Request) -> httpx.Response:
        assert request.url.params["checkpointing"] == "full"
        return httpx.Response(200, content=asked.content)

    with AutotuneClient("http://autotune.test", transport=httpx.MockTransport(service)) as client:
        made = client.plan("small", 256, device="cpu", checkpointing="full", allow_unconfirmed=True)
    assert isinstance(made, CheckpointedPlan) and made.checkpointing == "full"
    workload = made.apply(examples.gpt(**SMALL))
    assert workload.checkpointing == "full"
    model = made.apply(workload.build_model())
    assert checkpointing.applied(model)


def test_the_fresh_processes_confirm_the_chosen_setting(auto: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The request each confirmation run rebuilds the workload from names the setting chosen, not the
    choice: a `full` answer confirmed without checkpointing would run out of memory (or not repeat)."""
    from autotune.engine import confirm
    from autotune.engine import probe as probing
    from autotune.results import ProbeResult

    result = ProbeResult.model_validate(auto)
    choice = result.checkpointing
    assert choice is not None
    chose_full = result.model_copy(update={"checkpointing": choice.model_copy(update={"chosen": "full"})})
    monkeypatch.setattr(probing, "run_probe", lambda request, **_: chose_full)
    seen: list[ProbeRequest] = []

    def confirming(result: ProbeResult, request: ProbeRequest, *_: Any) -> ProbeResult:
        seen.append(request)
        return result

    monkeypatch.setattr(confirm, "confirm_answers", confirming)
    request = ProbeRequest(target="gpt", options=SMALL, device="cpu", memory=MEMORY, checkpointing="auto")
    confirm._probe_and_confirm(request, 60, True, None, None, None)
    assert [r.checkpointing for r in seen] == ["full"]


def test_the_summary_prints_each_setting_and_the_plot_marks_each_curve(
    auto: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from autotune.cli.summary import print_summary
    from autotune.plot import draw
    from autotune.results import ProbeResult

    result = ProbeResult.model_validate(auto)
    print_summary(result)
    printed = capsys.readouterr().out
    chosen = result.checkpointing.chosen  # type: ignore[union-attr]
    assert f"{chosen} (chosen)" in printed and "trials in all settings" in printed
    for c in auto["checkpointing"]["candidates"]:
        assert f"{c['max_micro_batch']} / {c['max_micro_batch_without_accumulation']}" in printed
        assert f"{c['samples_per_second']:.1f}" in printed
    figure = draw(result)
    legend = [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    other = next(c["setting"] for c in auto["checkpointing"]["candidates"] if c["setting"] != chosen)
    assert f"checkpointing {other}" in legend, legend
    assert f"checkpointing {chosen} (chosen)" in figure.axes[0].get_title()


def test_accelerate_tunes_with_the_same_block_wrapping_and_leaves_the_chosen_setting_on_the_model(
    accelerate: Any,
) -> None:
    from autotune.integrations.accelerate import tune_accelerator
    from tests.test_integration_accelerate import FEATURES, Rows, mse
    from tests.test_integration_accelerate import MEMORY as ROWS_MEMORY

    torch.manual_seed(0)
    widths = [FEATURES, 128, 128, 128]
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(128, 1))  # (Linear, GELU) three times: three segments
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = tune_accelerator(
        accelerate.Accelerator(cpu=True),
        model,
        optimizer,
        Rows(),
        effective_batch=960,
        loss=mse,
        memory=ROWS_MEMORY,
        headroom=0,
        checkpointing="auto",
        check_gradients=False,
        progress=False,
    )
    none, full = result.checkpointing.candidates  # type: ignore[union-attr]
    assert full.max_micro_batch_without_accumulation > none.max_micro_batch_without_accumulation
    chosen = result.checkpointing.chosen  # type: ignore[union-attr]
    assert result.workload.checkpointing == (None if chosen == "none" else chosen)
    assert checkpointing.applied(model) == (chosen != "none")


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's PossibleUserWarning (a small loader, no workers)
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning")
def test_lightning_probes_the_setting_through_the_block_wrapping_and_fits_with_it(tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch")
    from autotune.integrations.lightning import AutotuneBatchSize
    from tests import lightning_job

    gc.freeze()  # Lightning, imported just now, out of the collector's reach (tests/conftest.py's rule)
    tuner = AutotuneBatchSize(
        effective_batch=lightning_job.EFFECTIVE_BATCH,
        memory=lightning_job.MEMORY,
        headroom=0,
        checkpointing="full",
        check_gradients=False,
        progress=False,
    )
    module = lightning_job.Net()  # its Sequential: (Conv2d, BatchNorm2d, ReLU) twice, then the head
    trainer = lightning_job.trainer(tmp_path, max_steps=1, callbacks=[tuner])
    trainer.fit(module)
    assert tuner.result is not None and tuner.result.workload.checkpointing == "full"
    assert checkpointing.applied(module) and module.steps_run >= 1  # the fit ran checkpointed
