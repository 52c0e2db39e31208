"""The node's status page, `GET /`, as a person sees it.

The browser tests run a real `autotune serve` (with a token) whose NVML is the stand-in module,
one H100 with a training process on it (a `sitecustomize` on the server's PYTHONPATH puts it in
place of pynvml), run a real probe on the CPU budget device through the HTTP API, watch its trials
appear on the page while it runs, ask a plan from its result, then open the page in the system's
Chromium, driven by Playwright, and check what is on the screen: the GPU's row with its memory
bar and process, the budget device, the result with its largest micro-batch, its picture (loaded),
its plan; and a screenshot. The in-process tests check the empty page and that text users wrote
(workload descriptions, device names, run-failure messages) cannot put markup on the page.
"""

from __future__ import annotations

import asyncio
import html
import os
import re
import struct
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest

from api import create_app
from autotune.devices import nvml
from autotune.settings import Settings
from tests.nvml_standin import FakeNvml
from tests.serving import ROOT, WORKLOADS_TOML, Server, finished_probe, make_result, running_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
TOKEN = "status-page-token"
GiB = 2**30

# The server's pynvml: an H100 with 60 GiB held by one process (and the driver's 0.5 GiB).
SITECUSTOMIZE = """\
import sys

from tests.nvml_standin import FakeGpu, FakeNvml

sys.modules["pynvml"] = FakeNvml(
    [FakeGpu(uuid="GPU-5a7e0000-0000-0000-0000-000000000000", used=60 * 2**30, processes=[(4242, 59 * 2**30)])]
)
"""


@dataclass
class Probed:
    server: Server
    probe_id: str
    live_trials: int  # the most trial rows the page showed for the probe while it ran


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Probed]:
    """A server with one finished probe of `tiny` and a plan asked from its result."""
    directory = tmp_path_factory.mktemp("status")
    site = directory / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {"PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    with running_server(directory, token=TOKEN, env=env) as server, server.client(TOKEN) as client:
        created = client.post("/v1/probes", json={"workload": "tiny", "device": "cpu"})
        assert created.status_code == 202, created.text
        probe_id = created.json()["id"]
        # While it runs, the page shows it with its trials so far (then it is left to finish).
        live = 0
        deadline = time.monotonic() + 60
        while not live and time.monotonic() < deadline:
            page = client.get("/")
            assert page.status_code == 200, page.text
            article = re.search(
                rf'<article class="probe" id="probe-{probe_id}" data-status="running">(.*?)</article>', page.text, re.S
            )
            if article:
                live = article.group(1).count('<tr class="trial">')
            elif client.get(f"/v1/probes/{probe_id}").json()["status"] in ("succeeded", "failed"):
                break
            time.sleep(0.1)
        assert finished_probe(client, probe_id)["status"] == "succeeded", server.output()
        plan = client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 64, "device": "cpu"})
        assert plan.status_code == 200, plan.text
        assert plan.json()["plan"]["micro_batches"] == [16, 16, 16, 16]
        # A plan with unequal micro-batches and its warning, a long line of text: the whole plan
        # must still show (it widened the table beyond its box, which cut off the last columns).
        uneven = client.get("/v1/plan", params={"workload": "tiny", "effective_batch": 100, "device": "cpu"})
        assert uneven.status_code == 200, uneven.text
        assert uneven.json()["plan"]["warnings"], uneven.text
        yield Probed(server=server, probe_id=probe_id, live_trials=live)


def test_a_running_probe_shows_its_trials_on_the_page(probed: Probed) -> None:
    assert probed.live_trials >= 1, "the page showed no trial while the probe ran"


def test_the_page_needs_the_token_as_the_v1_reads_do(probed: Probed) -> None:
    with probed.server.client() as anonymous:
        refused = anonymous.get("/")
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == "Bearer"
    with probed.server.client("wrong") as wrong:
        assert wrong.get("/").status_code == 401
    with probed.server.client(TOKEN) as client:
        assert "/" not in client.get("/openapi.json").json()["paths"]  # a page for people, not an API


@pytest.fixture(scope="module")
def chromium() -> Path:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it as root (apt-get install chromium)")
    return CHROMIUM


def test_the_page_in_a_real_browser(probed: Probed, chromium: Path, tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(
                viewport={"width": 1280, "height": 900}, extra_http_headers={"Authorization": f"Bearer {TOKEN}"}
            )
            page = context.new_page()
            problems: list[str] = []
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.on("response", lambda r: problems.append(f"{r.status} {r.url}") if r.status >= 400 else None)
            response = page.goto(f"{probed.server.url}/", wait_until="load")
            assert response is not None and response.status == 200
            assert page.title().startswith("autotune · ")

            # The GPU: its model, a memory bar filled to what is in use (60.5 of 80 GiB), its process.
            gpu = page.locator("#device-cuda-0")
            assert "NVIDIA H100 80GB HBM3" in gpu.inner_text()
            assert "pid 4242 · 59.0 GiB" in gpu.locator(".processes").inner_text()
            assert "60.5 GiB in use of 80.0 GiB" in gpu.inner_text()
            bar = gpu.get_by_role("meter")
            assert int(bar.get_attribute("aria-valuenow") or 0) == int(60.5 * GiB)
            outer, fill = bar.bounding_box(), bar.locator(".fill").bounding_box()
            assert outer is not None and fill is not None
            assert fill["width"] / outer["width"] == pytest.approx(60.5 / 80, abs=0.02)
            cpu = page.locator("#device-cpu")
            assert cpu.is_visible() and "4.0 MiB by default" in cpu.inner_text()

            # No probe left running; the finished one, succeeded.
            assert page.get_by_text("No probe queued or running on this node.").is_visible()
            assert "succeeded" in page.locator(f"#finished-{probed.probe_id}").inner_text()

            # The result: workload, the answer, its plan and its picture, loaded.
            result = page.locator('article.result[data-workload="tiny"]')
            assert result.count() == 1
            assert result.locator(".max-micro-batch").inner_text() == "16"
            assert "the cap fitted" in result.inner_text()
            plans = result.locator("tr.plan")
            assert plans.count() == 2
            cells = plans.filter(has_text="4 × 16").locator("td").all_inner_texts()
            assert cells[:5] == ["64", "1", "fewest-steps", "4 × 16", "4"]
            picture = result.locator("img.plot")
            assert picture.get_attribute("src") == f"/v1/probes/{probed.probe_id}/plot.png"
            assert picture.evaluate("img => img.complete && img.naturalWidth > 0 && img.naturalHeight > 0")
            shown = picture.bounding_box()
            assert shown is not None and shown["width"] > 300 and shown["height"] > 150
            assert problems == []

            shot = tmp_path / "status.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    png = shot.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", png[16:24])
    assert width == 1280 and height >= 900
    assert len(png) > 50_000, "the screenshot is nearly blank"


# Every element that reaches past the right edge of the viewport, or of a box that scrolls or clips it.
OVERFLOWING = """() => {
  const width = document.documentElement.clientWidth;
  const found = [];
  for (const el of document.querySelectorAll("body *")) {
    const box = el.getBoundingClientRect();
    if (box.width === 0 || box.height === 0) continue;
    if (box.right > width + 0.5) found.push(`${el.tagName.toLowerCase()}.${el.className}: right ${box.right}`);
  }
  for (const el of document.querySelectorAll(".scroll")) {
    if (el.scrollWidth > el.clientWidth) found.push(`a .scroll box hides ${el.scrollWidth - el.clientWidth} px`);
  }
  return {page: document.documentElement.scrollWidth, width, found};
}"""


@pytest.mark.parametrize(("width", "height"), [(1280, 900), (390, 844)], ids=["desktop-1280", "phone-390"])
def test_the_whole_plan_shows_and_the_page_fits_the_screen(
    probed: Probed, chromium: Path, width: int, height: int
) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(
                viewport={"width": width, "height": height},
                device_scale_factor=1,
                is_mobile=width < 500,
                has_touch=width < 500,
                extra_http_headers={"Authorization": f"Bearer {TOKEN}"},
            )
            page = context.new_page()
            response = page.goto(f"{probed.server.url}/", wait_until="load")
            assert response is not None and response.status == 200
            layout = page.evaluate(OVERFLOWING)
            # No horizontal scrolling: the page is as wide as the screen, and nothing sticks out.
            assert layout["page"] <= width, layout
            assert layout["found"] == [], layout
            # Every cell of every plan is on the screen, the micro-batches and steps included.
            result = page.locator('article.result[data-workload="tiny"]')
            for row in result.locator("tr.plan, tr.plan-warning").all():
                for cell in row.locator("td").all():
                    box = cell.bounding_box()
                    assert box is not None and box["width"] > 0, cell.inner_text()
                    assert box["x"] >= 0 and box["x"] + box["width"] <= width + 0.5, (cell.inner_text(), box)
            uneven = result.locator("tr.plan", has_text="5 × 14")
            assert uneven.locator(".micro-batches").inner_text() == "2 × 15, 5 × 14"
            assert uneven.locator("td").nth(4).inner_text().endswith("7")  # the steps
            assert result.locator("tr.plan-warning").first.is_visible()
            if width < 500:  # a phone: each row a card of labelled values
                label = uneven.locator(".micro-batches").evaluate("td => getComputedStyle(td, '::before').content")
                assert "Micro-batches per rank" in label
        finally:
            browser.close()


# In-process: the app over httpx's ASGI transport ------------------------------------------------
def _run(tmp_path: Path, workloads: str, body: Callable[[httpx.AsyncClient], Awaitable[None]], inventory: Any) -> None:
    path = tmp_path / "workloads.toml"
    path.write_text(workloads)
    settings = Settings(db=str(tmp_path / "page.db"), workloads=path, cpu_memory=4 * 2**20)
    app = create_app(settings, inventory=inventory)

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
                await body(client)

    asyncio.run(scenario())


def _no_nvml() -> Any:
    import pynvml

    return nvml.inventory(FakeNvml([], errors={"nvmlInit": pynvml.NVML_ERROR_LIBRARY_NOT_FOUND}))


def test_an_empty_node_says_so(tmp_path: Path) -> None:
    async def body(client: httpx.AsyncClient) -> None:
        page = await client.get("/")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert page.headers["cache-control"] == "no-store"
        text = page.text
        assert "No results stored yet." in text
        assert "No probe queued or running on this node." in text
        assert "No GPU listed: the NVML library (libnvidia-ml.so.1) was not found" in text
        assert 'id="device-cpu"' in text and "4.0 MiB by default" in text
        assert '<meta http-equiv="refresh" content="5">' in text

    _run(tmp_path, WORKLOADS_TOML, body, _no_nvml)


HOSTILE_DESCRIPTION = "<script>alert('description')</script><img src=x onerror=alert(1)>"
HOSTILE_DEVICE = '<b onclick="alert(2)">device</b> & co'
HOSTILE_MESSAGE = '</td></tr></table><script>alert("message")</script>'


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def test_text_users_wrote_cannot_put_markup_on_the_page(tmp_path: Path) -> None:
    options = "{ in_features = 64, hidden = 64, layers = 1, classes = 10 }"
    workloads = f'[workloads.evil]\ntarget = "mlp"\ndescription = "{HOSTILE_DESCRIPTION}"\noptions = {options}\n'
    result = make_result(device_name=HOSTILE_DEVICE)

    async def body(client: httpx.AsyncClient) -> None:
        published = await client.post("/v1/results", json=result.model_dump(mode="json"))
        assert published.status_code == 201, published.text
        report = {"workload": "evil", "micro_batch": 12, "accumulates": True, "message": HOSTILE_MESSAGE}
        reported = await client.post("/v1/run-failures", json=report)
        assert reported.status_code == 200, reported.text
        page = await client.get("/")
        assert page.status_code == 200
        assert "script-src" not in page.headers["content-security-policy"]  # default-src 'none': no script
        text = page.text
        for hostile in (HOSTILE_DESCRIPTION, HOSTILE_DEVICE, HOSTILE_MESSAGE):
            assert hostile not in text  # as markup: never
            assert hostile in html.unescape(text)  # as text: shown
        assert "&lt;script&gt;alert(&#39;description&#39;)&lt;/script&gt;" in text
        assert "&lt;b onclick=&#34;alert(2)&#34;&gt;device&lt;/b&gt; &amp; co" in text
        assert "&lt;/td&gt;&lt;/tr&gt;&lt;/table&gt;&lt;script&gt;" in text
        parser = _Tags()
        parser.feed(text)
        assert not [t for t, _ in parser.tags if t == "script"]
        assert not [t for t, attrs in parser.tags if any(name.startswith("on") for name in attrs)]
        assert [t for t, _ in parser.tags if t == "img"] == []  # a published result has no picture here
        assert "No picture: this result was published" in text
        assert '<article class="result"' in text and 'data-workload="evil"' in text

    _run(tmp_path, workloads, body, _no_nvml)


def test_a_result_says_what_a_rank_was_probed_in_and_how_to_ask_for_its_plan(tmp_path: Path) -> None:
    """A plain result, an FSDP2 one and one probed with another budget and no headroom, all of one
    workload: the page tells them apart, and each one's no-plan hint, asked with a number, is
    answered by that result (a query without its fields finds another result, or starts a probe)."""
    from autotune.results import ParallelSpec

    plain = make_result(max_micro_batch=10, max_batch_cap=16)
    spec = ParallelSpec(strategy="fsdp", world_size=4, reshard_after_forward=False)
    ref = plain.workload.model_copy(update={"parallel": spec})
    sharded = make_result(max_micro_batch=14, max_batch_cap=16, workload=ref)
    other = make_result(max_micro_batch=12, max_batch_cap=16, total_bytes=8 * 2**20, headroom_bytes=0)
    assert len({plain.fingerprint, sharded.fingerprint, other.fingerprint}) == 3

    async def body(client: httpx.AsyncClient) -> None:
        for result in (plain, sharded, other):
            published = await client.post("/v1/results", json=result.model_dump(mode="json"))
            assert published.status_code == 201, published.text
        text = html.unescape((await client.get("/")).text)
        articles = re.findall(r'<article class="result".*?</article>', text, re.S)
        assert len(articles) == 3
        by_answer = {int(re.search(r'max-micro-batch">(\d+)<', a).group(1)): a for a in articles}  # type: ignore[union-attr]
        fsdp = by_answer[14]
        assert "per rank of a 4-rank FSDP2 job (per-block, gathered parameters kept for backward)" in fsdp
        assert "Parallel" not in by_answer[10] and "Parallel" not in by_answer[12]
        hints = {answer: re.search(r"GET /v1/plan\?(\S+)</code>", a).group(1) for answer, a in by_answer.items()}  # type: ignore[union-attr]
        assert hints[10] == "workload=tiny&effective_batch=N&device=cpu"
        assert hints[14].endswith("&parallel=fsdp&world_size=4&reshard_after_forward=false")
        assert hints[12] == f"workload=tiny&effective_batch=N&device=cpu&memory={8 * 2**20}&headroom=0"
        for answer, hint in hints.items():
            asked = await client.get("/v1/plan?" + hint.replace("=N", "=112"))
            assert asked.status_code == 200, (hint, asked.text)
            assert asked.json()["max_micro_batch"] == answer, hint

    _run(tmp_path, WORKLOADS_TOML, body, _no_nvml)
