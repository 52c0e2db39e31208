"""A small Dockerfile reader for the tests: instructions with continuation lines joined, comments
dropped, exec-form (JSON) arguments decoded. Enough for the instructions docker/Dockerfile uses;
not a general parser."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case: FROM, RUN, ENV, ...
    text: str  # the arguments, continuation lines joined with single spaces

    def exec_form(self) -> list[str]:
        """The arguments of an exec-form instruction (`CMD ["a", "b"]`) as a list."""
        value = json.loads(self.text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{self.keyword} is not in exec form: {self.text}")
        return value


@dataclass(frozen=True)
class Healthcheck:
    options: dict[str, str]
    command: list[str]


def instructions(path: Path = DOCKERFILE) -> list[Instruction]:
    found: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment lines, also between continuation lines
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        found.append(Instruction(keyword.upper(), rest.strip()))
    return found


def last(keyword: str, path: Path = DOCKERFILE) -> Instruction:
    """The instruction that takes effect (the last one of its kind: CMD, ENTRYPOINT, USER, ...)."""
    matches = [i for i in instructions(path) if i.keyword == keyword]
    if not matches:
        raise LookupError(f"{path} has no {keyword}")
    return matches[-1]


def env(path: Path = DOCKERFILE) -> dict[str, str]:
    """Every ENV key=value, later ones winning."""
    values: dict[str, str] = {}
    for instruction in instructions(path):
        if instruction.keyword == "ENV":
            for pair in shlex.split(instruction.text):
                key, sep, value = pair.partition("=")
                if not sep:
                    raise ValueError(f"write ENV as key=value: {instruction.text}")
                values[key] = value
    return values


def healthcheck(path: Path = DOCKERFILE) -> Healthcheck:
    text = last("HEALTHCHECK", path).text
    options: dict[str, str] = {}
    while text.startswith("--"):
        option, _, text = text.partition(" ")
        key, _, value = option[2:].partition("=")
        options[key] = value
        text = text.strip()
    keyword, _, command = text.partition(" ")
    if keyword.upper() != "CMD":
        raise ValueError(f"HEALTHCHECK without CMD: {text}")
    return Healthcheck(options, Instruction("CMD", command.strip()).exec_form())
