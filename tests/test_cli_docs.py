"""docs/cli.md names every flag of every command, as the command line declares them (issue 38: its
table lacked 8 of the probe's flags, `--save` among them), and says what each exit code and signal
means."""

from __future__ import annotations

import re
from typing import Any

import typer.main

from autotune.cli import app
from tests.docs_text import prose, section


def _documented(title: str) -> set[str]:
    """The flags in the first column of the tables of docs/cli.md's section `title`."""
    flags: set[str] = set()
    for line in section("docs/cli.md", title).splitlines():
        if line.startswith("| `"):
            first = line.split(" | ", 1)[0]
            for span in re.findall(r"`([^`]*)`", first):
                flags.update(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", span))
    return flags


def _declared(command: Any) -> set[str]:
    return {
        flag
        for param in command.params
        if param.param_type_name == "option"
        for flag in (*param.opts, *param.secondary_opts)
    }


def test_docs_cli_lists_every_flag_of_every_command() -> None:
    group = typer.main.get_command(app)
    commands: dict[str, Any] = group.commands  # type: ignore[attr-defined]
    assert {"probe", "plan", "estimate", "serve", "devices", "version"} <= set(commands)
    for name, command in commands.items():
        documented, declared = _documented(f"autotune {name}"), _declared(command)
        assert documented == declared, (
            f"docs/cli.md's `autotune {name}` table: missing {sorted(declared - documented)}, "
            f"not flags of the command {sorted(documented - declared)}"
        )
    assert _documented("Every command") == _declared(group) | {"-h", "--help"}


def test_start_batch_says_it_needs_the_plain_search() -> None:
    (row,) = [line for line in section("docs/cli.md", "autotune probe").splitlines() if "`--start-batch N`" in line]
    assert "`--search plain` only" in row
    command = typer.main.get_command(app).commands["probe"]  # type: ignore[attr-defined]
    (option,) = [p for p in command.params if "--start-batch" in p.opts]
    assert "--search plain only" in (option.help or "")


def test_every_exit_code_and_signal_is_explained() -> None:
    table = section("docs/cli.md", "Exit codes and signals")
    codes = [int(code) for code in re.findall(r"^\| (\d+) \|", table, re.M)]
    assert codes == [0, 1, 2, 4, 130, 143]
    said = prose(table)
    for words in ("Ctrl-C (SIGINT) or SIGTERM", "within a second", "A second Ctrl-C", "SIGKILL", "exits 0"):
        assert words in said, words
