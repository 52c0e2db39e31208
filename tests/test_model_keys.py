"""Request keys follow the model: editing a registered workload's model (its structure or its
source) changes the key, so the service stops answering from results probed before the edit.

The workload lives in two temporary files, as a user's would: `<name>.py` with the workload
function (the `module:attribute` target) and `<name>_nets.py` with the model class. An edit is
seen by dropping both modules from `sys.modules`, as a restarted server would start without them,
with bytecode caching off so that an edit within the same second is never read from a stale .pyc.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from autotune.engine.probe import ProbeRequest
from autotune.errors import ConfigError, ProbeError
from autotune.results import ProbeResult, TrialRecord
from autotune.workloads.probekey import DeviceKey, key_for_request, key_from_result, result_model_problems
from autotune.workloads.registry import Registry, load_registry
from tests.serving import ROOT, make_result

MiB = 2**20

NETS = '''"""The user's model."""
from torch import nn

HIDDEN = {hidden}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))

    def forward(self, x):
        return self.body(x){extra}
'''

WORKLOAD = '''"""The user's workload."""
import torch

from autotune.workloads.workload import Workload
from {nets} import Net


def workload() -> Workload:
    return Workload(
        name="edited",
        build_model=Net,
        make_batch=lambda b, device: torch.randn(b, 64, device=device),
        loss=lambda model, x: model(x).logsumexp(-1).mean(),
        input_spec={{"features": 64}},
    )
'''


@dataclass
class UserCode:
    directory: Path
    module: str
    toml: Path

    @property
    def nets(self) -> Path:
        return self.directory / f"{self.module}_nets.py"

    @property
    def workload_file(self) -> Path:
        return self.directory / f"{self.module}.py"

    def write_model(self, hidden: int, extra: str = "") -> None:
        self.nets.write_text(NETS.format(hidden=hidden, extra=extra))

    def forget(self) -> None:
        """Drop the imported modules: the next load imports the files as they are now."""
        for name in (self.module, f"{self.module}_nets"):
            sys.modules.pop(name, None)
        importlib.invalidate_caches()

    def load(self) -> Registry:
        self.forget()
        return load_registry(self.toml)


@pytest.fixture
def user_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[UserCode]:
    module = f"user_workload_{uuid.uuid4().hex[:12]}"
    toml = tmp_path / "workloads.toml"
    toml.write_text(f'[workloads.edited]\ntarget = "{module}:workload"\n')
    code = UserCode(tmp_path, module, toml)
    code.workload_file.write_text(WORKLOAD.format(nets=f"{module}_nets"))
    code.write_model(256)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield code
    code.forget()


def _cpu() -> DeviceKey:
    return DeviceKey(kind="cpu-budget", total_bytes=4 * MiB)


def _digest(registry: Registry, name: str) -> str:
    return key_for_request(registry.get(name), _cpu(), budget="total", memory=None, headroom=0.05).digest()


def _identity(registry: Registry) -> dict[str, tuple[str, str, str]]:
    return {e.name: (e.model_fingerprint, e.source_hash, _digest(registry, e.name)) for e in registry}


def test_an_unchanged_workload_keeps_its_key_across_loads(user_code: UserCode) -> None:
    first = user_code.load()
    assert {"mlp", "cnn", "gpt", "edited"} <= set(first.names())
    again = load_registry(user_code.toml)  # the modules still imported
    reloaded = user_code.load()  # imported afresh from the same files
    assert _identity(first) == _identity(again) == _identity(reloaded)
    entry = first.get("edited")
    assert len(entry.model_fingerprint) == len(entry.source_hash) == 64


def test_editing_the_hidden_width_changes_the_key(user_code: UserCode) -> None:
    before = user_code.load()
    old = before.get("edited")
    old_result = make_result(target=old.target, options={})  # as a probe of the 256-wide model reports it
    assert result_model_problems(old_result, old) == []

    user_code.write_model(4096)
    after = user_code.load()
    new = after.get("edited")
    assert new.model_fingerprint != old.model_fingerprint
    assert new.source_hash != old.source_hash
    assert _digest(after, "edited") != _digest(before, "edited")
    # The built-ins are untouched by the user's edit.
    assert {k: v for k, v in _identity(after).items() if k != "edited"} == {
        k: v for k, v in _identity(before).items() if k != "edited"
    }
    # The old result cannot be published under the new key: its fingerprint names the old model.
    problems = result_model_problems(old_result, new)
    assert [where for where, _ in problems] == [("fingerprint",)]
    assert "different model" in problems[0][1]
    # One probed from the edited model can, and gets the key plan queries now compute.
    new_result = make_result(target=new.target, options={})
    assert new_result.fingerprint != old_result.fingerprint
    assert result_model_problems(new_result, new) == []
    published = key_from_result(new_result, new)
    assert published is not None
    assert published.digest() == _digest(after, "edited")


def test_an_edit_of_the_model_source_alone_changes_the_key(user_code: UserCode) -> None:
    before = user_code.load().get("edited")
    user_code.write_model(256, extra="\n\n# checkpointing could go here: the structure stays, the code does not\n")
    after = user_code.load().get("edited")
    assert after.model_fingerprint == before.model_fingerprint
    assert after.source_hash != before.source_hash


def test_the_source_hash_covers_the_users_files_only(user_code: UserCode) -> None:
    from autotune.workloads import fingerprint
    from autotune.workloads.targets import resolve

    entry = user_code.load().get("edited")
    workload = resolve(entry.target)
    model, _ = fingerprint.build_on_meta(workload, batch=False)
    files = fingerprint.source_files(fingerprint.workload_objects(entry.target, workload, model))
    assert files == sorted([user_code.nets.resolve(), user_code.workload_file.resolve()])
    # An unrelated file next to them changes nothing.
    (user_code.directory / "notes.py").write_text("x = 1\n")
    assert user_code.load().get("edited").source_hash == entry.source_hash


def test_a_new_process_computes_the_same_keys_and_loads_fast(user_code: UserCode) -> None:
    here = _identity(user_code.load())
    script = (
        "import json, sys\n"
        "from autotune.workloads.probekey import DeviceKey, key_for_request\n"
        "from autotune.workloads.registry import load_registry\n"
        "r = load_registry(__import__('pathlib').Path(sys.argv[1]))\n"
        "cpu = DeviceKey(kind='cpu-budget', total_bytes=4 * 2**20)\n"
        "ids = {e.name: [e.model_fingerprint, e.source_hash,\n"
        "    key_for_request(e, cpu, budget='total', memory=None, headroom=0.05).digest()] for e in r}\n"
        "heavy = [m for m in ('torch._dynamo', 'sympy') if m in sys.modules]\n"
        "print(json.dumps({'ids': ids, 'heavy': heavy}))\n"
    )
    env_path = [str(user_code.directory), str(ROOT)]
    done = subprocess.run(
        [sys.executable, "-B", "-c", script, str(user_code.toml)],
        cwd=ROOT,
        env={**_plain_env(), "PYTHONPATH": ":".join(env_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    there = json.loads(done.stdout)
    assert {k: tuple(v) for k, v in there["ids"].items()} == here  # the built-ins' keys too
    # Building on the meta device skipped initialization: loading imported none of torch's
    # compiler machinery (a second or more of start-up).
    assert there["heavy"] == [], "loading the registry imported torch's compiler machinery: start-up got slower"


def _plain_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("AUTOTUNE_", "PYTHON"))}


def test_a_model_that_cannot_be_built_on_meta_is_refused_at_load(user_code: UserCode) -> None:
    user_code.nets.write_text(
        "import torch\nfrom torch import nn\n\n\nclass Net(nn.Module):\n"
        "    def __init__(self) -> None:\n        super().__init__()\n"
        "        width = int(torch.ones(1).sum().item())  # needs a value: meta tensors have none\n"
        "        self.body = nn.Linear(64, width)\n"
    )
    with pytest.raises(ConfigError, match="meta device") as info:
        user_code.load()
    assert "edited" in str(info.value)
    assert str(user_code.toml) in str(info.value)


def test_what_a_result_states_about_its_model_must_match() -> None:
    registry = load_registry(None)
    entry = registry.get("cnn")  # has BatchNorm
    assert result_model_problems(make_result(target="cnn", options={}), entry) == []
    batch_norm = make_result(target="cnn", options={}, batch_norm=False)
    assert [w for w, _ in result_model_problems(batch_norm, entry)] == [("batch_norm",)]
    spec = make_result(target="cnn", options={})
    spec = spec.model_copy(
        update={"workload": spec.workload.model_copy(update={"input_spec": {"image_size": 32, "classes": 100}})}
    )
    assert ("workload", "input_spec") in [w for w, _ in result_model_problems(spec, entry)]
    other = make_result(target="cnn", options={})
    other = other.model_copy(update={"workload": other.workload.model_copy(update={"optimizer": "FusedLAMB"})})
    assert [w for w, _ in result_model_problems(other, entry)] == [("workload", "optimizer")]


# End to end: the service, restarted on the same database after the model was edited ------------
def _refuse(request: ProbeRequest, timeout: float, on_trial: Callable[[TrialRecord], None]) -> ProbeResult:
    raise ProbeError("no probes in this test")


def _with_app(user_code: UserCode, db: Path, body: Callable[[httpx.AsyncClient], Awaitable[None]]) -> None:
    from api import create_app
    from autotune.settings import Settings

    user_code.forget()  # the server starts without the user's modules, as a new process would
    toml = user_code.directory / "only.toml"
    toml.write_text("builtins = false\n" + user_code.toml.read_text())
    settings = Settings(db=str(db), workloads=toml, cpu_memory=4 * MiB, headroom=0.05)
    app = create_app(settings, runner=_refuse)

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
                await body(client)

    asyncio.run(scenario())


PLAN: dict[str, str | int] = {"workload": "edited", "effective_batch": 24, "device": "cpu"}


def test_after_an_edit_and_a_restart_the_old_result_no_longer_answers(user_code: UserCode, tmp_path: Path) -> None:
    db = tmp_path / "autotune.db"
    old = make_result(target=f"{user_code.module}:workload", options={})
    fingerprint = old.fingerprint
    old_key = key_from_result(old, user_code.load().get("edited"))
    assert old_key is not None

    async def publish_and_plan(client: httpx.AsyncClient) -> None:
        stored = await client.post("/v1/results", json=old.model_dump(mode="json"))
        assert stored.status_code == 201, stored.text
        plan = await client.get("/v1/plan", params=PLAN)
        assert plan.status_code == 200, plan.text
        assert plan.json()["fingerprint"] == fingerprint  # the key it was published under is the plan's
        assert stored.json()["request_key"] == old_key.digest()

    async def still_answered(client: httpx.AsyncClient) -> None:
        plan = await client.get("/v1/plan", params=PLAN)
        assert plan.status_code == 200, plan.text
        assert plan.json()["fingerprint"] == fingerprint

    async def no_longer_answered(client: httpx.AsyncClient) -> None:
        plan = await client.get("/v1/plan", params=PLAN)
        assert plan.status_code in (202, 409), plan.text  # a probe of the edited model is needed
        assert plan.json()["probe"]["request_key"] != old_key.digest()
        kept = await client.get(f"/v1/results/{fingerprint}")
        assert kept.status_code == 200  # kept, not deleted
        again = await client.post("/v1/results", json=old.model_dump(mode="json"))
        assert again.status_code == 409, again.text  # its claim conflicts with the model registered now
        assert again.json()["code"] == "model_mismatch"
        assert "fingerprint: " in again.json()["detail"]

    _with_app(user_code, db, publish_and_plan)
    _with_app(user_code, db, still_answered)  # a restart alone changes nothing
    user_code.write_model(4096)
    _with_app(user_code, db, no_longer_answered)
