"""In a real browser: JupyterLab on 127.0.0.1 driven by Debian's headless Chromium through Playwright.

* the quickstart notebook runs top to bottom in JupyterLab and its layer explorer renders (the
  heatmap's SVG), redraws when the statistic dropdown changes, and fetches nothing from outside
  the machine (``JupyterChart.enable_offline()``); a second explorer of the same run in the same
  page: both heatmap legends draw their swatches, no chart's SVG refers to an id outside itself,
  both detail panes are open on load; a screenshot of each is saved under the test's tmp dir;
* the standalone HTML report opens from a file with every chart drawn, no request, and no script
  run from a module named ``<script>alert(1)</script>``.

Skipped, with the reason, only where ``/usr/bin/chromium`` is absent (``apt-get install -y chromium``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"

if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is absent: install it with `apt-get update && apt-get install -y chromium`",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab server on a free localhost port with token and password off and every
    config / data / runtime / settings / workspace directory inside tmp_path; always shut down."""
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    env = dict(os.environ)
    for var, sub in (("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_DATA_DIR", "data"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                     ("JUPYTERLAB_SETTINGS_DIR", "settings"), ("JUPYTERLAB_WORKSPACES_DIR", "workspaces"),
                     ("IPYTHONDIR", "ipython")):
        (tmp_path / sub).mkdir()
        env[var] = str(tmp_path / sub)
    env["OMP_NUM_THREADS"] = "1"  # small CPU models on a shared 2-core box
    # no "official Jupyter news?" toast over the screenshot, no update check
    notif = tmp_path / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    notif.parent.mkdir(parents=True)
    notif.write_text('{"fetchNews": "false", "checkForUpdates": false}')
    port = free_port()
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.open_browser=False",
         "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
         "--IdentityProvider.token=", "--ServerApp.password=", f"--ServerApp.root_dir={root}",
         "--ServerApp.allow_root=True", "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
         "--LabApp.extension_manager=readonly",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"JupyterLab did not start; log:\n{(tmp_path / 'jupyterlab.log').read_text()[-3000:]}")
            time.sleep(0.3)
        yield url, root
    finally:
        try:
            req = urllib.request.Request(f"{url}/api/shutdown", method="POST")
            urllib.request.urlopen(req, timeout=5).close()
            proc.wait(timeout=15)
        except Exception:
            pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()


def check_two_explorers(page, tmp_path) -> None:
    """Both explorers of the page: every SVG reference (``url(#id)``: gradients, clip paths)
    resolves inside its own chart, each heatmap legend draws its swatches with a fill, each detail
    pane is open (band and histogram drawn, findings listed) without a click; one screenshot each."""
    dangling = page.evaluate("""() => {
        const bad = [];
        for (const svg of document.querySelectorAll('.mpscope-explorer svg')) {
            for (const el of svg.querySelectorAll('*')) {
                for (const attr of ['fill', 'stroke', 'clip-path', 'mask', 'filter']) {
                    const v = el.getAttribute(attr) || '';
                    const m = v.match(/url\\(['"]?[^#)]*#([^)'"]+)['"]?\\)/);
                    if (m && !svg.querySelector('#' + CSS.escape(m[1]))) bad.push(attr + '=' + v);
                }
            }
        }
        return bad;
    }""")
    assert not dangling, f"chart SVGs reference ids outside themselves: {dangling[:5]}"
    explorers = page.locator(".mpscope-explorer")
    assert explorers.count() == 2
    for i in range(2):
        e = explorers.nth(i)
        fills = e.locator(".mpscope-heatmap svg g.role-legend-symbol path").evaluate_all(
            "els => els.map(p => p.getAttribute('fill') || getComputedStyle(p).fill)")
        assert len(fills) >= 5 and all(f and f != "none" for f in fills), fills  # one swatch per class
        assert len(set(fills)) >= 5, fills
        labels = e.locator(".mpscope-heatmap svg g.role-legend-label text").evaluate_all(
            "els => els.map(t => t.textContent)")
        # the legend names the limits: the format's (log2 absmax) or the fraction bands
        magnitude = any("65504" in t for t in labels) and any("2^-14" in t for t in labels)
        fraction = any("≥ 50 %" in t for t in labels) and any("0.1 % – 1 %" in t for t in labels)
        assert magnitude or fraction, labels
        assert e.locator(".mpscope-band svg g.mark-area path").count() >= 1  # detail open without a click
        assert e.locator(".mpscope-histogram svg").count() == 1
        assert "findings" in e.inner_text() and "first at step" in e.inner_text()
        e.evaluate("el => el.scrollIntoView({block: 'start'})")
        page.wait_for_timeout(200)
        shot = tmp_path / f"explorer_{i + 1}.png"
        e.screenshot(path=str(shot))
        print(f"\nexplorer {i + 1} screenshot: {shot}")
        assert shot.stat().st_size > 10_000


def test_quickstart_explorer_renders_and_responds(browser, jupyterlab, tmp_path):
    url, root = jupyterlab
    t0 = time.monotonic()
    lap = lambda what: print(f"  [{time.monotonic() - t0:5.1f} s] {what}")  # noqa: E731
    # a second explorer of the same run in the same page: charts must not depend on each other
    # (two explorers' SVG legends must not share gradient ids, or one legend points into the other)
    import json as _json

    nb = _json.loads((root / NOTEBOOK.name).read_text())
    nb["cells"].append({"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                        "source": ["%mpscope explore"]})
    (root / NOTEBOOK.name).write_text(_json.dumps(nb))
    page = browser.new_page(viewport={"width": 1400, "height": 2400})
    outside = []
    page.on("request", lambda r: outside.append(r.url)
            if not r.url.startswith((url, "data:", "blob:", "about:")) else None)
    page.goto(f"{url}/lab/tree/{NOTEBOOK.name}")
    page.wait_for_function("window.jupyterapp && window.jupyterapp.shell.currentWidget"
                           " && window.jupyterapp.shell.currentWidget.sessionContext"
                           " && window.jupyterapp.shell.currentWidget.sessionContext.session"
                           " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
                           timeout=60_000)
    page.wait_for_function("window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status === 'idle'",
                           timeout=60_000)
    lap("notebook open, kernel idle")
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    # the last cell writes mpscope-out/report.html; the heatmap is drawn by then
    deadline = time.monotonic() + 150
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    while not (root / "mpscope-out" / "report.html").exists():
        failed = [t for t in errors.all_inner_texts() if "Traceback" in t]
        assert not failed, f"a quickstart cell raised in JupyterLab:\n{failed[0][-2000:]}"
        assert time.monotonic() < deadline, "the quickstart did not finish running in JupyterLab"
        time.sleep(0.5)
    lap("all cells ran")
    page.wait_for_function("document.querySelectorAll('.mpscope-explorer .mpscope-heatmap svg g.mark-rect path')"
                           ".length > 0 && document.querySelectorAll('.mpscope-explorer').length === 2"
                           " && [...document.querySelectorAll('.mpscope-explorer')].every("
                           "e => e.querySelector('.mpscope-heatmap svg g.mark-rect path')"
                           " && e.querySelector('.mpscope-band svg'))", timeout=90_000)
    heat = page.locator(".mpscope-heatmap svg").first
    lap("two explorers drawn")
    check_two_explorers(page, tmp_path)
    lap("both legends and detail panes checked")
    tracebacks = [t for t in errors.all_inner_texts() if "Traceback" in t or "Error" in t]
    assert not tracebacks, tracebacks
    # the heatmap: one rect per (module, step) cell of the activation role
    marks = heat.locator("g.mark-rect path")
    page.wait_for_function("document.querySelector('.mpscope-heatmap svg g.mark-rect path') !== null", timeout=30_000)
    n_cells = marks.count()
    assert n_cells > 50
    before = heat.inner_html()
    # change the statistic in its dropdown (an ipywidgets <select>): the chart must be redrawn
    select = page.locator(".mpscope-statistic select").first
    select.select_option(label="fp16 overflow fraction")  # it opened on the finding's statistic
    page.wait_for_function(
        "(b) => { const s = document.querySelector('.mpscope-heatmap svg'); return s && s.innerHTML !== b; }",
        arg=before, timeout=30_000)
    lap("heatmap redrawn for the new statistic")
    after = page.locator(".mpscope-heatmap svg").first.inner_html()
    assert after != before
    assert "fp16_overflow_frac" in after and "fp16_overflow_frac" not in before  # the legend title
    # click a heatmap cell: the detail panel opens with the band and histogram charts
    page.locator(".mpscope-heatmap svg g.mark-rect path").nth(n_cells // 2).click()
    page.locator(".mpscope-band svg").first.wait_for(state="visible", timeout=30_000)
    page.locator(".mpscope-histogram svg").first.wait_for(state="visible", timeout=30_000)
    chosen = page.locator(".mpscope-module select").first
    page.wait_for_function("(el) => el.selectedIndex > 0", arg=chosen.element_handle(), timeout=30_000)
    module = chosen.evaluate("el => el.options[el.selectedIndex].text")
    assert module in page.locator(".mpscope-explorer").first.inner_text()
    lap("detail opened by a click")
    page.locator(".mpscope-explorer").first.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(300)
    shot = tmp_path / "explorer.png"
    page.screenshot(path=str(shot))
    print(f"\nexplorer screenshot: {shot}")
    assert shot.stat().st_size > 10_000
    assert not outside, f"the page fetched from outside the machine: {outside[:5]}"
    page.close()


def test_report_opens_offline_and_runs_no_injected_script(browser, tmp_path):
    import torch

    import mpscope
    from mpscope.report import embedded_specs

    evil = "<script>alert(1)</script>"
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module(evil, torch.nn.Linear(4, 8))
    model.add_module("out", torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with mpscope.record(model, optimizer=opt, shadow=True) as rec:  # the fp32 shadow's SQNR charts too
        for _ in range(2):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 4)).float().pow(2).mean()
            loss.backward()
            opt.step()
    path = rec.run.report(tmp_path / "report.html")
    text = path.read_text(encoding="utf-8")
    n_charts = text.count('class="chart"')
    titles = json.dumps([s.get("title") for s in embedded_specs(text)], ensure_ascii=False)
    assert "SQNR against the float32 reference" in titles and "(root): SQNR against float32" in titles

    page = browser.new_page(viewport={"width": 1300, "height": 900})
    dialogs, requests, errors = [], [], []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.on("request", lambda r: requests.append(r.url) if not r.url.startswith("file:") else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_function(f"document.querySelectorAll('.chart svg').length === {n_charts}", timeout=30_000)
    assert not dialogs and not requests and not errors, (dialogs, requests, errors)
    assert evil in page.locator("body").inner_text()  # shown as text
    shot = tmp_path / "report.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"\nreport screenshot: {shot}")
    page.close()
