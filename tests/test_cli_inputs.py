"""What the CLI says to bad input: one line naming the flag (or variable), exit 2, no traceback,
and nothing slow first. In-process (`autotune.cli.run`), with the probe itself replaced by a
failure: every row must be refused before a probe starts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from autotune import __version__, cli
from autotune.cli import probe as probe_command
from autotune.cli.summary import print_summary
from autotune.plans.plan import plan

ROOT = Path(__file__).resolve().parent.parent


def factory() -> None:
    """A target named like the user's nwl:factory: its message holds ":factory:" (an emoji code)."""


@pytest.fixture
def autotune(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., tuple[int, str, str]]:
    """Run the CLI in this process: (exit code, stdout, stderr). A probe that starts fails the test."""

    def no_probe(*args: object, **kwargs: object) -> None:
        raise AssertionError("a probe started: the input should have been refused before it")

    monkeypatch.setattr(probe_command, "run_with_progress", no_probe)
    monkeypatch.chdir(ROOT)
    for name in (
        "AUTOTUNE_PROBE_TIMEOUT",
        "AUTOTUNE_CPU_MEMORY",
        "AUTOTUNE_HEADROOM",
        "AUTOTUNE_BUDGET",
        "AUTOTUNE_MAX_CPU_MEMORY",
    ):
        monkeypatch.delenv(name, raising=False)

    def invoke(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli.run(list(args))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return invoke


PROBE = ("probe", "mlp", "--device", "cpu", "--memory", "64MiB")
DIRECTORY = str(ROOT / "tests")

# (arguments, environment, exit code, what stderr must say: the flag or variable, and the problem)
ROWS: list[tuple[tuple[str, ...], dict[str, str], int, tuple[str, ...]]] = [
    # output paths, refused before the probe (the probe's work would be lost after it)
    ((*PROBE, "--plot", "/nonexistent/dir/p.png"), {}, 2, ("--plot", "/nonexistent/dir does not exist")),
    ((*PROBE, "--plot", DIRECTORY), {}, 2, ("--plot", "is a directory")),
    ((*PROBE, "--plot", ""), {}, 2, ("--plot is empty",)),
    ((*PROBE, "--plot", "x.gif"), {}, 2, ("--plot 'x.gif'", "name the file x.png")),
    ((*PROBE, "--plot", "/proc/p.png"), {}, 2, ("--plot '/proc/p.png' cannot be written",)),
    ((*PROBE, "--save", "/nonexistent/dir/r.json"), {}, 2, ("--save", "/nonexistent/dir does not exist")),
    ((*PROBE, "--save", DIRECTORY), {}, 2, ("--save", "is a directory")),
    ((*PROBE, "--save", ""), {}, 2, ("--save is empty",)),
    # timeouts: nan crashed, 0 meant 900 s, -1 was accepted
    ((*PROBE, "--timeout", "nan"), {}, 2, ("--timeout nan is not a number of seconds above 0",)),
    ((*PROBE, "--timeout", "0"), {}, 2, ("--timeout 0 is not",)),
    ((*PROBE, "--timeout", "-1"), {}, 2, ("--timeout -1 is not",)),
    ((*PROBE, "--timeout", "inf"), {}, 2, ("--timeout inf is not",)),
    # sizes: "" probed 256 MiB
    (("probe", "mlp", "--device", "cpu", "--memory", ""), {}, 2, ("--memory is empty",)),
    # the budget device allocates real host RAM: a cap (as the service's), and the host's RAM
    (("probe", "mlp", "--device", "cpu", "--memory", "80GB"), {}, 2, ("--memory", "AUTOTUNE_MAX_CPU_MEMORY")),
    (
        ("probe", "mlp", "--device", "cpu", "--memory", "1000TiB"),
        {"AUTOTUNE_MAX_CPU_MEMORY": "2000TiB"},
        2,
        ("--memory", "host RAM", "this host has"),
    ),
    # ... also when AUTOTUNE_CPU_MEMORY sets it (the child was killed by the host, reported as a crash)
    (
        ("probe", "mlp", "--device", "cpu"),
        {"AUTOTUNE_CPU_MEMORY": "80GB"},
        2,
        ("AUTOTUNE_CPU_MEMORY 74.5 GiB", "above AUTOTUNE_MAX_CPU_MEMORY", "lower AUTOTUNE_CPU_MEMORY or give --memory"),
    ),
    (
        ("probe", "mlp", "--device", "cpu"),
        {"AUTOTUNE_CPU_MEMORY": "1000TiB", "AUTOTUNE_MAX_CPU_MEMORY": "2000TiB"},
        2,
        ("AUTOTUNE_CPU_MEMORY", "this host has"),
    ),
    # a bare number is bytes: below a MiB, a unit was left out
    (("probe", "mlp", "--device", "cpu", "--memory", "1"), {}, 2, ("--memory 1 has no unit", "did you mean 1GiB")),
    (("probe", "mlp", "--device", "cpu", "--memory", "64"), {}, 2, ("--memory 64 has no unit", "64MiB?")),
    (("estimate", "gpt", "--memory", "80"), {}, 2, ("--memory 80 has no unit",)),
    (("probe", "gpt", "--memory", "12XB"), {}, 2, ("--memory", "cannot parse size '12XB'")),
    (("probe", "gpt", "--memory", "9" * 400), {}, 2, ("--memory", "too large")),
    (("probe", "gpt", "--headroom", ""), {}, 2, ("--headroom is empty",)),
    (("probe", "gpt", "--headroom", "150%"), {}, 2, ("--headroom", "headroom fraction must be in [0, 1)")),
    (("probe", "gpt", "--headroom", "5"), {}, 2, ("--headroom", "did you mean 5%?")),
    (("probe", "gpt", "--headroom", "1"), {}, 2, ("--headroom", "did you mean 1%?")),
    (("probe", "gpt", "--headroom", "1.0"), {}, 2, ("--headroom", "did you mean 1%?")),
    (("probe", "gpt", "--headroom", "1.5"), {}, 2, ("--headroom", "did you mean 1.5%?")),
    (("estimate", "gpt", "--memory", "1GiB", "--headroom", "5"), {}, 2, ("--headroom", "did you mean 5%?")),
    (("probe", "gpt", "--min-free-memory", "lots"), {}, 2, ("--min-free-memory", "cannot parse size 'lots'")),
    # plans too long to build: an OverflowError traceback before
    (("plan", "--effective-batch", "1" + "0" * 20, "--max-micro-batch", "1"), {}, 2, ("--effective-batch",)),
    ((*PROBE, "--effective-batch", "1" + "0" * 20), {}, 2, ("--effective-batch", "samples per rank")),
    ((*PROBE, "--effective-batch", "100000", "--max-batch", "2"), {}, 2, ("--effective-batch", "50,000")),
    (
        ("plan", "--effective-batch", "1000003", "--max-micro-batch", "1000", "--policy", "exact"),
        {},
        2,
        ("--policy exact", "--policy fewest-steps"),
    ),
    (
        ("plan", "--effective-batch", "10", "--max-micro-batch", "4", "--world-size", "4"),
        {},
        2,
        ("not a multiple of --world-size 4", "use 8 or 12"),
    ),
    ((*PROBE, "--effective-batch", "10", "--world-size", "4"), {}, 2, ("not a multiple of --world-size 4",)),
    # ranges: flags, not pydantic's field names
    (("serve", "--port", "70000"), {}, 2, ("'--port'", "65535")),
    (("serve", "--port", "0"), {}, 2, ("'--port'",)),
    (("probe", "gpt", "--max-batch", "0"), {}, 2, ("'--max-batch'",)),
    (("probe", "gpt", "--effective-batch", "0"), {}, 2, ("'--effective-batch'",)),
    (("probe", "gpt", "--steps", "1000"), {}, 2, ("'--steps'",)),
    (("probe", "gpt", "--prefetch", "-1"), {}, 2, ("'--prefetch'",)),
    (("probe", "gpt", "--max-batch", "4", "--granularity", "8"), {}, 2, ("--max-batch 4 is below --granularity 8",)),
    (("plan", "--effective-batch", "-5", "--max-micro-batch", "8"), {}, 2, ("'--effective-batch'",)),
    (
        ("plan", "--effective-batch", "5", "--max-micro-batch", "8", "--policy", "fastest"),
        {},
        2,
        ("--policy", "unknown policy 'fastest'"),
    ),
    # issue 13: one plan across GPU types (--group NAME:RANKS:MAX_MICRO_BATCH, --mixed)
    (("plan", "--effective-batch", "64"), {}, 2, ("--max-micro-batch is missing", "--group")),
    (("plan", "--effective-batch", "64", "--group", "H100"), {}, 2, ("--group 'H100' is not NAME:RANKS:MAX",)),
    (("plan", "--effective-batch", "64", "--group", "H100:four:8"), {}, 2, ("--group 'H100:four:8': ranks 'four'",)),
    (("plan", "--effective-batch", "64", "--group", "H100:4:0"), {}, 2, ("--group 'H100:4:0': max micro-batch '0'",)),
    (("plan", "--effective-batch", "64", "--group", ":4:8"), {}, 2, ("--group ':4:8' is not NAME:RANKS",)),
    (
        ("plan", "--effective-batch", "64", "--group", "A:2:8", "--group", "A:2:4"),
        {},
        2,
        ("--group 'A' is given twice",),
    ),
    (("plan", "--effective-batch", "3", "--group", "A:2:8", "--group", "B:2:4"), {}, 2, ("--effective-batch 3", "4")),
    (
        ("plan", "--effective-batch", "64", "--group", "A:2:8", "--max-micro-batch", "8"),
        {},
        2,
        ("--max-micro-batch is for a job on one GPU model",),
    ),
    (("plan", "--effective-batch", "64", "--group", "A:2:8", "--world-size", "4"), {}, 2, ("--world-size 4", "2")),
    (("plan", "--effective-batch", "64", "--group", "A:2:8", "--mixed", "mixed"), {}, 2, ("--mixed", "'mixed'")),
    (("plan", "--effective-batch", "64", "--max-micro-batch", "8", "--mixed", "uniform"), {}, 2, ("--mixed uniform",)),
    (
        ("plan", "--effective-batch", "65", "--group", "A:2:8", "--group", "B:2:4", "--mixed", "uniform"),
        {},
        2,
        ("--effective-batch 65 is not a multiple of the world size 4", "use 64 or 68", "--mixed per-model"),
    ),
    (
        ("plan", "--effective-batch", "64", "--group", "A:2:8", "--policy", "exact"),
        {},
        2,
        ("--policy exact", "--mixed uniform"),
    ),
    (
        ("plan", "--effective-batch", "1" + "0" * 12, "--group", "A:2:8"),
        {},
        2,
        ("--effective-batch 1000000000000", "more than the 10,000 planned"),
    ),
    (("estimate", "gpt", "--memory", ""), {}, 2, ("--memory is empty",)),
    (("estimate", "gpt", "--memory", "1GiB", "--overhead", "x"), {}, 2, ("--overhead", "cannot parse size 'x'")),
    # choices and other flags
    (("probe", "gpt", "--device", "tpu"), {}, 2, ("--device", "unknown device 'tpu'")),
    (("probe", "gpt", "--device", ""), {}, 2, ("--device", "unknown device ''")),
    (("probe", "gpt", "--policy", "fastest"), {}, 2, ("--policy", "unknown policy 'fastest'")),
    (("probe", "gpt", "--precision", "fp8"), {}, 2, ("--precision 'fp8' is not one of",)),
    (("probe", "gpt", "--search", "guess"), {}, 2, ("--search 'guess' is not one of plain, predict",)),
    (("probe", "gpt", "--budget", "half"), {}, 2, ("--budget 'half' is not one of",)),
    (("probe", "gpt", "-o", "seq_len"), {}, 2, ("-o/--option 'seq_len' is not key=value",)),
    (("probe", "gpt", "--publish", "autotune:8000"), {}, 2, ("--publish",)),
    (("probe",), {}, 2, ("Missing argument 'TARGET'", "autotune probe --help")),
    (("probe", "gpt", "--bogus"), {}, 2, ("No such option: --bogus",)),
    (("frobnicate",), {}, 2, ("No such command 'frobnicate'",)),
    # environment variables: named, with their value
    (PROBE, {"AUTOTUNE_PROBE_TIMEOUT": "nan"}, 2, ("AUTOTUNE_PROBE_TIMEOUT='nan'",)),
    (PROBE, {"AUTOTUNE_PROBE_TIMEOUT": "inf"}, 2, ("AUTOTUNE_PROBE_TIMEOUT='inf'",)),
    (PROBE, {"AUTOTUNE_CPU_MEMORY": "lots"}, 2, ("AUTOTUNE_CPU_MEMORY='lots'", "cannot parse size")),
    (PROBE, {"AUTOTUNE_HEADROOM": "5"}, 2, ("AUTOTUNE_HEADROOM='5'", "did you mean 5%?")),
    (PROBE, {"AUTOTUNE_BUDGET": "half"}, 2, ("AUTOTUNE_BUDGET='half'", "'total' or 'free'")),
    # user text that rich markup used to eat (--in-process: this process imports the workload; an
    # isolated probe leaves that to its child, test_workload_errors_cross_the_child_as_one_line)
    (
        ("probe", "tests.test_cli_inputs:factory", "-o", "x=1", "--in-process"),
        {},
        2,
        ("tests.test_cli_inputs:factory: factory()",),
    ),
    (("probe", "mlp", "-o", "shape=[batch, 16]", "--in-process"), {}, 2, ("'[batch, 16]'",)),
    (("probe", "tests.workloads:tiny", "-o", "x=1", "--in-process"), {}, 2, ("takes keyword options to pass ['x']",)),
    # targets: an unknown built-in or a module nowhere on the path, refused before any process
    # starts without importing anything; the rest where the workload is imported (--in-process here)
    (("probe", "resnet9000"), {}, 2, ("unknown workload 'resnet9000'",)),
    (("probe", "nwl:factory"), {}, 2, ("cannot import module 'nwl' for target 'nwl:factory'",)),
    (("probe", ":factory"), {}, 2, ("target ':factory' is neither a built-in example nor module:attribute",)),
    (
        ("probe", "tests.broken_import:workload", "--in-process"),
        {},
        2,
        ("No module named 'autotune_no_such_dependency'", "(at tests/broken_import.py:3 in <module>)"),
    ),
    (("probe", "gpt", "-o", "depth=3", "--in-process"), {}, 2, ("bad options",)),
    (("probe", "tests.workloads:nope", "--in-process"), {}, 2, ("module 'tests.workloads' has no attribute 'nope'",)),
    # issue 12: a module that exits on import, a factory whose own code fails: named, with the line
    (
        ("probe", "tests.exits_on_import:workload", "--in-process"),
        {},
        2,
        ("importing 'tests.exits_on_import'", "exited with code 3", "(at tests/exits_on_import.py:5", "__main__"),
    ),
    (
        ("probe", "tests.guard_workloads:bad_factory", "--in-process"),
        {},
        2,
        ("tests.guard_workloads:bad_factory() failed: KeyError: 'width' (at tests/guard_workloads.py:", "bad_factory)"),
    ),
    # issue 12: flags that had no effect are refused, naming why
    ((*PROBE, "--budget", "free"), {}, 2, ("--budget free applies to a CUDA device", "--device cpu is the cpu budget")),
    ((*PROBE, "--min-free-memory", "1GiB"), {}, 2, ("--min-free-memory applies to a CUDA device", "drop --min")),
    ((*PROBE, "--min-free-memory", "0"), {}, 2, ("--min-free-memory applies to a CUDA device",)),
    ((*PROBE, "--timeout", "60", "--in-process"), {}, 2, ("--timeout", "--in-process", "nothing kills")),
    ((*PROBE, "--start-batch", "64"), {}, 2, ("--start-batch 64 is for --search plain",)),
    ((*PROBE, "--no-confirm", "--confirm-steps", "3"), {}, 2, ("--confirm-steps 3", "--no-confirm skips it")),
    ((*PROBE, "--world-size", "4"), {}, 2, ("--world-size 4", "add --effective-batch E")),
    ((*PROBE, "--world-size", "4", "--parallel", "ddp"), {}, 2, ("--world-size 4", "DDP rank's answer")),
    ((*PROBE, "--policy", "exact"), {}, 2, ("--policy exact", "no --effective-batch is given")),
    ((*PROBE, "--start-batch", "64", "--search", "predict"), {}, 2, ("--start-batch 64", "--search plain")),
    # the caching allocator's flags (issue 21)
    ((*PROBE, "--allocator", "gpu"), {}, 2, ("--allocator 'gpu' is not one of exact, cuda",)),
    ((*PROBE, "--allocator-config", "expandable_segments:maybe"), {}, 2, ("--allocator-config 'expandable_segments",)),
    ((*PROBE, "--allocator-config", "nonsense:1", "--allocator", "cuda"), {}, 2, ("--allocator-config", "nonsense")),
    (
        (*PROBE, "--allocator", "exact", "--allocator-config", "expandable_segments:True"),
        {},
        2,
        ("use --allocator cuda",),
    ),
    ((*PROBE, "--compare-allocator-config", "expandable_segments:True"), {}, 2, ("add --allocator cuda",)),
    ((*PROBE, "--max-steps", "0"), {}, 2, ("--max-steps",)),
    (("probe", "mlp", "--device", "cuda:0", "--allocator", "cuda"), {}, 2, ("drop --allocator",)),
    ((*PROBE,), {"AUTOTUNE_ALLOCATOR": "gpu"}, 2, ("AUTOTUNE_ALLOCATOR",)),
    # issue 12: estimate (in this process: fake trials, a second each)
    (
        ("estimate", "tests.guard_workloads:flat", "--memory", "1GiB"),
        {},
        2,
        ("memory does not grow with the batch", "make_batch(batch_size, device)"),
    ),
    (
        ("estimate", "tests.guard_workloads:grouped_mm", "--memory", "1GiB", "--overhead", "0"),
        {},
        2,
        ("cannot be estimated", "aten._grouped_mm", "probe it on a device", "(at tests/guard_workloads.py:"),
    ),
    (("estimate", "tests.exits_on_import:workload", "--memory", "1GiB"), {}, 2, ("exited with code 3",)),
]


@pytest.mark.parametrize(("args", "env", "code", "says"), ROWS, ids=[" ".join(r[0])[:60] for r in ROWS])
def test_bad_input_is_one_line_naming_the_flag(
    autotune: Callable[..., tuple[int, str, str]],
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[str, ...],
    env: dict[str, str],
    code: int,
    says: tuple[str, ...],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    got, stdout, stderr = autotune(*args)
    assert got == code, (stdout, stderr)
    assert "Traceback" not in stderr + stdout
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr  # one line
    for text in says:
        assert text in stderr
    assert "{" not in stderr or "{'" in stderr  # no unformatted f-string left in a message


def test_json_failures_print_an_error_document(autotune: Callable[..., tuple[int, str, str]]) -> None:
    code, stdout, stderr = autotune(*PROBE, "--timeout", "nan", "--json")
    assert code == 2 and "--timeout nan" in stderr
    document = json.loads(stdout)
    assert document["error"]["type"] == "ConfigError" and document["error"]["exit_code"] == 2
    assert "--timeout nan" in document["error"]["message"]
    code, stdout, _ = autotune("plan", "--effective-batch", "0", "--max-micro-batch", "4", "--json")
    assert code == 2
    assert json.loads(stdout)["error"] == {
        "type": "UsageError",
        "message": json.loads(stdout)["error"]["message"],
        "exit_code": 2,
    }
    assert "--effective-batch" in json.loads(stdout)["error"]["message"]
    code, stdout, _ = autotune(*PROBE, "--timeout", "nan")
    assert code == 2 and stdout == ""  # without --json, nothing on stdout


@pytest.mark.parametrize(
    ("effective", "largest", "world", "policy"),
    [(100, 17, 1, "fewest-steps"), (2050, 1024, 1, "fewest-steps"), (100, 16, 1, "fewest-steps"),
     (4100, 1024, 2, "fewest-steps"), (100, 16, 1, "exact"), (64, 100, 1, "fewest-steps"), (96, 16, 4, "exact"),
     (7, 2, 1, "fewest-steps")],
)  # fmt: skip
def test_the_plan_arithmetic_is_exact(
    autotune: Callable[..., tuple[int, str, str]], effective: int, largest: int, world: int, policy: str
) -> None:
    code, stdout, stderr = autotune(
        "plan", "--effective-batch", str(effective), "--max-micro-batch", str(largest),
        "--world-size", str(world), "--policy", policy,
    )  # fmt: skip
    assert code == 0, stderr
    first = stdout.splitlines()[0]
    match = re.search(r": ([0-9 ×+()a-z]+) = effective batch (\d+)$", first)
    assert match, first
    expression = match.group(1).replace("×", "*").replace("world size", "")
    assert eval(expression, {"__builtins__": {}}) == effective == int(match.group(2)), first
    made = plan(effective, largest, world, policy)
    assert f"{made.accumulation_steps} accumulation steps" in first or made.accumulation_steps == 1
    assert "step(s)" not in first


def test_help_version_and_defaults(autotune: Callable[..., tuple[int, str, str]]) -> None:
    for flag in ("-h", "--help"):
        code, stdout, _ = autotune(flag)
        assert code == 0 and "Commands:" in stdout and "-V, --version" in stdout
    for flag in ("-V", "--version"):
        assert autotune(flag)[:2] == (0, f"{__version__}\n")
    code, stdout, _ = autotune("probe", "-h")
    assert code == 0
    assert "<bool>" not in stdout and "<str>" not in stdout.split("Options:")[1]
    help_text = " ".join(stdout.split())
    for default in (
        "AUTOTUNE_PROBE_TIMEOUT, 900",
        "AUTOTUNE_MIN_FREE_MEMORY, 1GiB",
        "AUTOTUNE_BUDGET, total",
        "AUTOTUNE_CPU_MEMORY, 256MiB",
        "AUTOTUNE_HEADROOM, 5%",
        "--confirm / --no-confirm",
    ):
        assert default in help_text
    code, stdout, _ = autotune("--help")
    devices = next(line for line in stdout.splitlines() if line.strip().startswith("devices"))
    assert devices.rstrip().endswith("processes.")  # one sentence, not cut in the middle


def test_help_and_bad_input_import_no_torch() -> None:
    """--help, --version and refused input answer without importing torch or the probe machinery."""
    script = (
        "import sys\n"
        "from autotune.cli import run\n"
        "codes = [run(a) for a in (['--help'], ['--version'], ['probe', '-h'], ['probe', 'mlp', '--timeout', 'nan'],"
        " ['plan', '--effective-batch', '100', '--max-micro-batch', '17'], ['serve', '--port', '70000'])]\n"
        "print(codes, 'torch' in sys.modules, 'autotune.engine.probe' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[0, 0, 0, 2, 0, 2] False False"


def test_the_summary_prints_user_text_as_it_is(capsys: pytest.CaptureFixture[str]) -> None:
    """Device names, OOM messages and notes are shown verbatim: no markup, no emoji codes."""
    from tests.serving import make_result

    result = make_result(target="nwl:factory", device_name="gpu:factory: [bold]x[/bold]", max_micro_batch=12)
    trials = [
        t.model_copy(update={"oom_message": "shape [batch, 16] :factory: out of memory"}) if not t.fits else t
        for t in result.trials
    ]
    result = result.model_copy(update={"trials": trials, "plan": plan(100, 12)})
    print_summary(result)
    stdout = capsys.readouterr().out
    assert "device: gpu:factory: [bold]x[/bold];" in stdout
    assert "13 ran out of memory: shape [batch, 16] :factory: out of memory" in stdout
    assert "9 accumulation steps of at most 12 (micro-batch × steps): 12 + 11 × 8 = effective batch 100" in stdout


def test_accepted_inputs_reach_the_probe_as_given(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[tuple[object, bool, float]] = []
    waits: list[bool] = []

    def stop(request: object, in_process: bool, timeout: float, *, wait: bool) -> None:
        seen.append((request, in_process, timeout))
        waits.append(wait)
        raise SystemExit(0)

    monkeypatch.setattr(probe_command, "run_with_progress", stop)
    monkeypatch.setenv("AUTOTUNE_PROBE_TIMEOUT", "60")
    # --min-free-memory is a CUDA device's (refused on the budget device), --timeout an isolated probe's.
    args = ["probe", "mlp", "--device", "cuda", "--memory", "64MiB", "--min-free-memory", "0", "--headroom", "0"]
    with pytest.raises(SystemExit):
        cli.run([*args, "--in-process", "-o", "hidden=8"])
    with pytest.raises(SystemExit):
        cli.run([*args, "--timeout", "1.5"])
    with pytest.raises(SystemExit):
        cli.run([*PROBE, "--search", "plain", "--start-batch", "64", "--no-wait"])
    (first, in_process, timeout), (_, isolated, given), (plain, _, _) = seen
    assert waits == [True, True, False]
    assert (first.min_free_memory, first.memory, first.headroom) == (0, 64 * 2**20, 0.0)  # type: ignore[attr-defined]
    assert first.options == {"hidden": 8} and in_process and not isolated  # type: ignore[attr-defined]
    assert (timeout, given) == (60.0, 1.5)
    assert (plain.search, plain.start_batch) == ("plain", 64)  # type: ignore[attr-defined]


def test_sizes_zero_only_where_allowed_and_no_overflow() -> None:
    from autotune.errors import ConfigError
    from autotune.units import parse_size

    assert parse_size("0", allow_zero=True) == parse_size("0GiB", allow_zero=True) == 0
    with pytest.raises(ConfigError, match="less than one byte"):
        parse_size("0")
    with pytest.raises(ConfigError, match="too large"):
        parse_size("9" * 400 + "GiB")


# Issue 12: guards, workload errors, estimate -------------------------------------------------------
GUARDS = "tests.guard_workloads"


def _reason(stderr: str) -> str:
    """stderr without the probe's progress lines (`trial   1: ...`, `confirm: ...`, `probing X: starting
    ...` when it has said nothing for a moment): what it said."""
    return "".join(
        line
        for line in stderr.splitlines(True)
        if not line.startswith(("trial ", "confirm: ")) and not re.match(r"probing \S+: starting", line)
    )


@pytest.fixture
def autotune_probing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Callable[..., tuple[int, str, str]]:
    """The CLI in this process, the probe really running (for probes that end in a few trials)."""
    monkeypatch.chdir(ROOT)
    for name in ("AUTOTUNE_PROBE_TIMEOUT", "AUTOTUNE_CPU_MEMORY", "AUTOTUNE_HEADROOM", "AUTOTUNE_DEBUG"):
        monkeypatch.delenv(name, raising=False)

    def invoke(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = cli.run(list(args))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return invoke


@pytest.mark.parametrize(
    "extra",
    [(), ("--search", "plain"), ("--max-batch", str(10**12)), ("--search", "plain", "--max-batch", str(10**12))],
    ids=["predict", "plain", "predict-cap", "plain-cap"],
)
def test_a_flat_memory_curve_is_an_error_naming_make_batch(
    autotune_probing: Callable[..., tuple[int, str, str]], extra: tuple[str, ...]
) -> None:
    """make_batch ignores the batch size: 1024 doublings and an OverflowError (plain), or the cap
    answered silently (10**12), before. Now one line naming make_batch, in a few trials."""
    code, stdout, stderr = autotune_probing(
        "probe", f"{GUARDS}:flat", "--device", "cpu", "--memory", "1MiB", "--in-process", "--no-confirm", *extra
    )
    assert code == 2, stderr
    stderr = _reason(stderr)
    assert stderr.startswith("error: memory does not grow with the batch") and stderr.count("\n") == 1, stderr
    assert "does make_batch(batch_size, device) return batch_size rows?" in stderr
    if "plain" in extra:
        assert "batch 1 peaked at" in stderr and "batch 1024 at" in stderr
    else:
        assert "the timeline trials at batch 2 and 4 both peak at" in stderr
    assert "Traceback" not in stdout + stderr and stdout == ""


def test_estimate_failures_say_estimate_failed(autotune_probing: Callable[..., tuple[int, str, str]]) -> None:
    code, _, stderr = autotune_probing("estimate", f"{GUARDS}:missing_key", "--memory", "1GiB", "--overhead", "0")
    assert code == 1
    assert stderr.startswith("estimate failed: batch ") and stderr.count("\n") == 1, stderr
    assert "KeyError: 'labels' (at tests/guard_workloads.py:24 in _loss)" in stderr


def test_debug_shows_the_traceback_in_this_process(
    autotune_probing: Callable[..., tuple[int, str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from autotune.settings import get_settings

    args = ("probe", f"{GUARDS}:missing_key", "--device", "cpu", "--memory", "1MiB", "--in-process")
    code, _, quiet = autotune_probing(*args)
    quiet = _reason(quiet)
    assert code == 1 and quiet.count("\n") == 1 and "Traceback" not in quiet
    monkeypatch.setenv("AUTOTUNE_DEBUG", "1")
    get_settings.cache_clear()  # read once per process, as a command runs once
    code, _, loud = autotune_probing(*args)
    loud = _reason(loud)
    assert code == 1 and loud.startswith("Traceback (most recent call last):")
    assert 'batch["labels"]' in loud and loud.endswith(quiet)  # the traceback, then the same line
    monkeypatch.delenv("AUTOTUNE_DEBUG")
    get_settings.cache_clear()
    assert _reason(autotune_probing("--debug", *args)[2]) == loud  # the root option says the same


def test_the_budget_device_without_device_flag(
    autotune: Callable[..., tuple[int, str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No --device and no CUDA is the budget device too: found from torch's build (+cpu) unimported."""
    from autotune import request

    monkeypatch.setattr(request, "cpu_only_torch", lambda: True)
    code, _, stderr = autotune("probe", "mlp", "--memory", "64MiB", "--budget", "free")
    assert code == 2 and "--budget free applies to a CUDA device, and without CUDA here" in stderr
    code, _, stderr = autotune("probe", "mlp", "--memory", "64MiB", "--min-free-memory", "2GiB")
    assert code == 2 and "--min-free-memory applies to a CUDA device" in stderr


def test_the_built_in_names_are_known_without_torch() -> None:
    from autotune.request import EXAMPLE_NAMES
    from autotune.workloads.examples import EXAMPLES

    assert tuple(sorted(EXAMPLES)) == EXAMPLE_NAMES


@pytest.mark.parametrize(
    ("target", "code", "says"),
    [
        ("tests.exits_on_import:workload", 2, "importing 'tests.exits_on_import' for target "),
        ("gpt -o depth=3", 2, "bad options {'depth': 3} for gpt"),
    ],
)
def test_workload_errors_cross_the_child_as_one_line(
    autotune_probing: Callable[..., tuple[int, str, str]], target: str, code: int, says: str
) -> None:
    """The parent no longer imports the workload: the isolated child finds what is wrong with it,
    and the same one line comes back (a sys.exit(3) on import used to exit 3 with no message)."""
    got, stdout, stderr = autotune_probing("probe", *target.split(), "--device", "cpu", "--memory", "1MiB")
    assert got == code, stderr
    stderr = _reason(stderr)
    assert stderr.startswith("error: " + says) and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stdout + stderr


def test_an_isolated_probe_imports_neither_torch_nor_the_workload_here_and_debug_shows_the_childs_traceback() -> None:
    script = (
        "import sys\n"
        "from autotune.cli import run\n"
        f"code = run(['probe', '{GUARDS}:missing_key', '--device', 'cpu', '--memory', '1MiB', '--debug'])\n"
        f"print(code, 'torch' in sys.modules, '{GUARDS}' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stdout.splitlines()[-1] == "1 False False", (done.stdout, done.stderr)
    lines = done.stderr.splitlines()
    # The child's traceback (the workload's frame, its source line), then the one-line reason.
    assert "Traceback (most recent call last):" in lines and 'batch["labels"]' in done.stderr
    assert lines[-1] == (
        "probe failed: batch 4 failed with an error that is not out-of-memory: KeyError: 'labels' "
        "(at tests/guard_workloads.py:24 in _loss)"
    )


def test_a_device_that_is_not_here_is_bad_input(autotune_probing: Callable[..., tuple[int, str, str]]) -> None:
    """No CUDA here (or no 99th GPU on a GPU machine): exit 2 as for any bad input, not 1."""
    code, stdout, stderr = autotune_probing("probe", "mlp", "--device", "cuda:99", "--memory", "1MiB", "--in-process")
    assert code == 2 and stdout == "", stderr
    stderr = _reason(stderr)
    assert stderr.startswith("error: ") and stderr.count("\n") == 1, stderr
    assert "--device cpu" in stderr or "cuda:99 does not exist" in stderr
