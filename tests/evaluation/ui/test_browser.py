"""The UI in a real browser: headless Chromium (Debian's chromium and chromium-driver) driven
by Selenium against a real ``trims gateway`` process serving a seeded results database.

Each page must load without a SEVERE browser console message, show the seeded rows, and leave
a full-page screenshot under ``$TRIMS_TEST_ARTIFACTS/ui`` (or the test's temp directory).
The gateway runs with its secure defaults: a generated admin token, and anonymous callers on
loopback may read and invoke, so the pages load without logging in.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from urllib.request import Request, urlopen

import pytest

from tests.evaluation.ui.seed import SPAN_NAMES, Seeded, seed
from tests.fixtures.gateway import GatewayProcess
from tests.fixtures.ui import FUNCS
from tests.fixtures.unprivileged import writable_by_functions
from trims.runtime.gateway.admin_token import admin_token_path

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
By = pytest.importorskip("selenium.webdriver.common.by").By

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs chromium and chromedriver (apt-get install chromium chromium-driver)",
)


def shared_with_functions(folder: Path) -> Path:
    """``folder`` writable, and its ancestors traversable, by the unprivileged user function
    code runs as when the tests run as root (what tests/fixtures/unprivileged.py does for
    ``tmp_path``, here for a module's temp folder)."""
    for ancestor in folder.parents:
        if ancestor == Path("/"):
            break
        if ancestor.stat().st_uid == os.getuid():
            ancestor.chmod(ancestor.stat().st_mode | 0o711)
    return writable_by_functions(folder)


@pytest.fixture(scope="module")
def seeded_module(tmp_path_factory: pytest.TempPathFactory) -> Seeded:
    seeded = seed(shared_with_functions(tmp_path_factory.mktemp("ui-db")) / "results.sqlite")
    seeded.path.chmod(0o666)
    return seeded


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[socket.socket]:
    """The listening Unix socket the evaluate stand-in connects to and waits on."""
    path = shared_with_functions(tmp_path_factory.mktemp("ui-gate")) / "gate.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        path.chmod(0o777)
        server.listen(1)
        server.settimeout(120)
        yield server


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, seeded_module: Seeded, gate: socket.socket
) -> Iterator[GatewayProcess]:
    root = tmp_path_factory.mktemp("ui-gateway")
    process = GatewayProcess(root, "--results-db", str(seeded_module.path), auth=True)
    process.start()
    try:
        token = admin_token_path(process.state_home / "trims" / "gateway").read_text().strip()
        spec = {
            "name": "evaluate",
            "handler": "uifuncs:evaluate",
            "code_dir": str(FUNCS),
            "config": {"db": str(seeded_module.path), "gate": gate.getsockname()},
        }
        put = Request(
            f"{process.url}/v1/functions/evaluate",
            data=json.dumps(spec).encode(),
            method="PUT",
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        with urlopen(put, timeout=30) as r:
            assert r.status in (200, 201)
        yield process
    finally:
        process.kill()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = os.environ.get("TRIMS_TEST_ARTIFACTS")
    folder = Path(base) / "ui" if base else tmp_path_factory.mktemp("ui-screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def visit(driver: Any, url: str, shot: Path) -> None:
    """Load ``url``; fail on SEVERE console messages; save a full-page screenshot."""
    driver.get_log("browser")  # drop what earlier pages logged
    driver.get(url)
    assert driver.execute_script("return document.readyState") == "complete"
    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == [], severe
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, max(1000, min(int(height) + 120, 6000)))
    assert driver.save_screenshot(str(shot)), f"no screenshot of {url}"
    driver.set_window_size(1400, 1000)


def until(driver: Any, url_part: str, *, end: bool = False) -> None:
    """Wait for the navigation a click started to reach a URL containing ``url_part`` (with
    ``end``: whose path ends with it; the page a form is on may carry it in its query, as
    ``/ui/login?next=/ui/run`` does), and for that page to finish loading."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 30).until(
        lambda d: (
            urlsplit(d.current_url).path.endswith(url_part) if end else url_part in d.current_url
        )
    )
    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script("return document.readyState") == "complete"
    )


def cells(driver: Any, table_id: str) -> list[list[str]]:
    rows = driver.find_elements(By.CSS_SELECTOR, f"table#{table_id} tbody tr")
    return [[c.text for c in r.find_elements(By.CSS_SELECTOR, "th, td")] for r in rows]


def test_overview_shows_the_deployed_function(
    browser: Any, gateway: GatewayProcess, artifacts: Path
) -> None:
    visit(browser, f"{gateway.url}/ui/", artifacts / "overview.png")
    (row,) = cells(browser, "functions")
    assert row[0] == "evaluate" and row[1] == "uifuncs:evaluate"


def test_evaluations_table_shows_the_seeded_rows(
    browser: Any, gateway: GatewayProcess, seeded_module: Seeded, artifacts: Path
) -> None:
    visit(browser, f"{gateway.url}/ui/evaluations", artifacts / "evaluations.png")
    rows = cells(browser, "evaluations")
    assert [int(r[1]) for r in rows] == sorted(seeded_module.ids, reverse=True)
    assert [r[3] for r in rows] == ["digits-mlp", *["mnist-cnn-onnxruntime"] * 2]


def test_filter_and_compare_from_the_list_render_the_charts(
    browser: Any, gateway: GatewayProcess, artifacts: Path
) -> None:
    from selenium.webdriver.support.ui import Select

    browser.get(f"{gateway.url}/ui/evaluations")
    Select(browser.find_element(By.ID, "f-model")).select_by_visible_text("mnist-cnn-onnxruntime")
    browser.find_element(By.CSS_SELECTOR, "form.filters button[type=submit]").click()
    until(browser, "model=mnist-cnn-onnxruntime")
    assert len(cells(browser, "evaluations")) == 2
    browser.get(f"{gateway.url}/ui/evaluations")
    for box in browser.find_elements(By.CSS_SELECTOR, "input[name=e]"):
        box.click()
    browser.find_element(By.XPATH, "//button[text()='Compare selected']").click()
    until(browser, "/ui/compare?")
    visit(browser, browser.current_url, artifacts / "compare.png")
    for chart, bars in (("qps", 3), ("latency", 6)):
        svg = browser.find_element(By.CSS_SELECTOR, f"#chart-{chart} svg")
        assert len(svg.find_elements(By.CSS_SELECTOR, "g[id*='-bar-']")) == bars
    scatter = browser.find_element(By.CSS_SELECTOR, "#chart-accuracy svg")
    assert len(scatter.find_elements(By.CSS_SELECTOR, "g[id^='accuracy-point-']")) == 3
    assert [r[0] for r in cells(browser, "grid")] == ["digits-mlp", "mnist-cnn-onnxruntime"]


def test_evaluation_detail_shows_its_plot_and_accuracy(
    browser: Any, gateway: GatewayProcess, seeded_module: Seeded, artifacts: Path
) -> None:
    url = f"{gateway.url}/ui/evaluations/{seeded_module.ids[0]}"
    visit(browser, url, artifacts / "evaluation.png")
    svg = browser.find_element(By.CSS_SELECTOR, "figure svg")
    assert len(svg.find_elements(By.CSS_SELECTOR, "g[id*='-bar-']")) == 4
    (acc,) = cells(browser, "accuracy")
    assert acc[1:3] == ["98.50%", "98.00%"]


def test_trace_timeline_shows_the_span_tree(
    browser: Any, gateway: GatewayProcess, seeded_module: Seeded, artifacts: Path
) -> None:
    visit(browser, f"{gateway.url}/ui/traces", artifacts / "traces.png")
    assert cells(browser, "stored-traces")[0][0] == seeded_module.trace_id
    browser.find_element(By.LINK_TEXT, seeded_module.trace_id).click()
    until(browser, f"/ui/traces/{seeded_module.trace_id}")
    visit(browser, browser.current_url, artifacts / "trace.png")
    names = browser.find_elements(By.CSS_SELECTOR, "svg.timeline text.span-name")
    assert tuple(n.text for n in names) == SPAN_NAMES
    link = browser.find_element(By.PARTIAL_LINK_TEXT, "Chrome trace JSON")
    assert link.get_attribute("href").endswith(f"/ui/traces/{seeded_module.trace_id}?format=chrome")


def test_layers_run_and_login_pages(browser: Any, gateway: GatewayProcess, artifacts: Path) -> None:
    visit(browser, f"{gateway.url}/ui/layers", artifacts / "layers.png")
    assert len(cells(browser, "layer-results")) == 4
    assert browser.find_elements(By.CSS_SELECTOR, "#chart-bounds svg g[id*='-bar-']")
    visit(browser, f"{gateway.url}/ui/run", artifacts / "run.png")
    assert browser.find_element(By.ID, "model").tag_name == "select"
    visit(browser, f"{gateway.url}/ui/login?next=/ui/run", artifacts / "login.png")
    token = admin_token_path(gateway.state_home / "trims" / "gateway").read_text().strip()
    browser.find_element(By.ID, "token").send_keys(token)
    browser.find_element(By.CSS_SELECTOR, "main form button[type=submit]").click()
    until(browser, "/ui/run", end=True)
    assert browser.find_element(By.XPATH, "//button[text()='Log out']")
    assert browser.get_cookie("trims_ui_session")["httpOnly"] is True


def test_keyboard_reaches_the_skip_link_first(browser: Any, gateway: GatewayProcess) -> None:
    from selenium.webdriver.common.keys import Keys

    browser.get(f"{gateway.url}/ui/evaluations")
    browser.find_element(By.TAG_NAME, "body").send_keys(Keys.TAB)
    focused = browser.switch_to.active_element
    assert focused.text == "Skip to content"
    focused.send_keys(Keys.ENTER)
    assert browser.switch_to.active_element.get_attribute("id") == "content"


def test_an_evaluation_started_in_the_browser_shows_progress_then_its_result(
    browser: Any, gateway: GatewayProcess, gate: socket.socket, artifacts: Path
) -> None:
    from selenium.webdriver.support.ui import Select

    browser.get(f"{gateway.url}/ui/run")
    Select(browser.find_element(By.ID, "model")).select_by_visible_text("digits-mlp")
    Select(browser.find_element(By.ID, "scenario")).select_by_visible_text("offline")
    browser.find_element(By.XPATH, "//button[text()='Start the evaluation']").click()
    until(browser, "/ui/runs/")
    visit(browser, browser.current_url, artifacts / "progress.png")
    assert browser.find_element(By.TAG_NAME, "h1").text == "evaluate: running"
    assert browser.find_elements(By.TAG_NAME, "progress")
    connection, _ = gate.accept()  # the function is running and waits for the word
    with connection:
        connection.sendall(b"go")
    until(browser, "/ui/evaluations/")  # the page's own refresh lands on the result
    visit(browser, browser.current_url, artifacts / "run-result.png")
    assert "digits-mlp (offline)" in browser.find_element(By.TAG_NAME, "h1").text
