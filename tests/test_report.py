"""The standalone HTML report: self-contained (no network), escaped, and showing the run's numbers."""

from __future__ import annotations

import base64
import gzip
import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mpscope
from loops import record_fp16

alt = pytest.importorskip("altair")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("vl_convert")

from mpscope.report import MAX_STEP_COLUMNS, embedded_specs, write_report  # noqa: E402

EVIL = "<script>alert(1)</script>"


class Collect(HTMLParser):
    """Every tag with its attributes, the text of every <script>, and the visible text."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[str] = []
        self.text: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"
        if self._in_script:
            self.scripts.append("")

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += data
        else:
            self.text.append(data)


class Evil(torch.nn.Module):
    """A real model whose submodule name is an HTML script element (add_module accepts it)."""

    def __init__(self):
        super().__init__()
        self.add_module(EVIL, torch.nn.Linear(8, 16))
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.out(torch.relu(getattr(self, EVIL)(x)))


@pytest.fixture(scope="module")
def evil_run():
    torch.manual_seed(0)
    model = Evil()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)) for _ in range(3)]
    return record_fp16(model, opt, scaler, batches)


def test_report_is_self_contained_and_escapes_module_names(evil_run, tmp_path):
    run = evil_run
    assert EVIL in set(run.tensors["module"].astype(str))  # precondition: the recorder kept the name
    path = write_report(run, tmp_path / "report.html")
    text = path.read_text(encoding="utf-8")
    assert EVIL not in text  # never raw, anywhere (markup or script)
    p = Collect()
    p.feed(text)
    # self-contained: no external script, stylesheet, image or frame; nothing to fetch
    for tag, attrs in p.tags:
        for attr in ("src", "href", "data"):
            assert not attrs.get(attr), f"<{tag} {attr}={attrs.get(attr)!r}> needs the network"
    assert not re.search(r"@import|url\(\s*['\"]?https?:", text)
    # exactly the two scripts we wrote: the inlined vega bundle and the embedding code
    assert len(p.scripts) == 2 and len(p.scripts[0]) > 100_000
    assert "vegaEmbed" in p.scripts[1] and "DecompressionStream" in p.scripts[1]
    # the escaped name is visible as text (the HTML parser unescapes it back)
    assert EVIL in "".join(p.text)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    # chart specs: gzip + base64 (no "<" can end the script early), data inlined, read back with
    # the standard library alone
    m = re.fullmatch(r'\s*const mpscopeSpecsGzip = "([A-Za-z0-9+/=]+)";\n.*', p.scripts[1], re.S)
    specs = json.loads(gzip.decompress(base64.b64decode(m.group(1))))
    assert specs == embedded_specs(text)
    assert len(specs) == text.count('class="chart"') >= 5
    schema = json.loads((Path(alt.__file__).parent / "vegalite" / alt.SCHEMA_VERSION.split(".")[0] / "schema"
                         / "vega-lite-schema.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    for spec in specs:
        errors = list(validator.iter_errors(spec))
        assert not errors, errors[0].message[:300]
    names = {row.get("module") for s in specs for rows in s.get("datasets", {}).values() for row in rows}
    assert EVIL in names
    assert all("url" not in json.dumps(s.get("data", {})) for s in specs)


def test_report_shows_the_run_numbers(evil_run, tmp_path):
    run = evil_run
    path = run.report(tmp_path / "r.html")  # the lead's Run.report calls write_report
    text = path.read_text(encoding="utf-8")
    specs = embedded_specs(text)
    # the activation heatmap holds log2 absmax per (module, step) from run.tensors
    t = run.tensors[run.tensors["role"] == "activation"]
    want = {(str(r.module), int(r.step)): r.absmax for r in t.itertuples()}
    heat = next(s for s in specs if "activation: log2 absmax" in json.dumps(s.get("title", "")))
    rows = next(iter(heat["datasets"].values()))
    assert len(rows) == len(want)
    for row in rows:
        assert 2.0 ** row["value"] == pytest.approx(want[(row["module"], row["step"])], rel=1e-12)
    # the timeline holds every step's loss and scale
    tl = next(s for s in specs if "vconcat" in s)
    rows = next(iter(tl["datasets"].values()))
    assert [r["loss"] for r in rows] == pytest.approx(run.steps["loss"].tolist())
    assert [r["loss_scale_min"] for r in rows] == run.steps["loss_scale"].tolist()
    # the recommendation is the advisor's own HTML
    advice = mpscope.advise(run)
    assert advice._repr_html_() in text


def test_report_errors_say_what_to_do(evil_run, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_report(evil_run, tmp_path / "missing" / "r.html")
    with pytest.raises(TypeError, match="mpscope.Run"):
        write_report(object(), tmp_path / "r.html")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_report_draws_the_limits_of_the_format_the_run_computes_in(dtype, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with mpscope.record(model, opt) as rec:
        for _ in range(2):
            with torch.autocast("cpu", dtype=dtype):
                loss = model(torch.randn(16, 8)).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    page = rec.run.report(tmp_path / "r.html").read_text()
    text = page + json.dumps(embedded_specs(page), ensure_ascii=False)  # the markup and the charts
    fi = torch.finfo(torch.bfloat16)
    bf16 = f"bf16 min subnormal 2^{int(math.log2(fi.smallest_normal * fi.eps))}"  # 2^-133
    fp16 = f"fp16 max {torch.finfo(torch.float16).max:.6g}"
    assert (bf16 in text, fp16 in text) == ((True, False) if dtype == torch.bfloat16 else (False, True))


# ----------------------------------------------------------------------------- a run longer than the columns
LONG_STEPS = 130  # > 2 * MAX_STEP_COLUMNS: heatmap columns of 3 steps


@pytest.fixture(scope="module")
def long_run():
    """A float16-autocast MLP trained for LONG_STEPS steps on a loss so small that its activation
    gradients (float16, loss scale 1) are mostly subnormal, with one weight element (1e-9) that a cast
    to float16 flushes to 0 (lr 0: the weights stay as set). Returns the Run and, per step, the
    gradient of module "0"'s output as PyTorch handed it to a tensor hook of our own."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight[0, 0] = 1e-9
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    grads: list[torch.Tensor] = []

    def tap(module, inputs, out):
        out.register_hook(lambda g: grads.append(g.detach().clone()))

    model[0].register_forward_hook(tap)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)) for _ in range(LONG_STEPS)]
    with mpscope.record(model, optimizer=opt, scaler=scaler) as rec:
        for step, (x, y) in enumerate(batches):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x).float()
            loss = 1e-4 * (1 + step % 7) * F.mse_loss(out, y)  # gradients of 1e-7 .. 1e-5: subnormal in fp16
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert len(grads) == LONG_STEPS
    return rec.run, model, grads


@pytest.fixture(scope="module")
def long_report(long_run, tmp_path_factory):
    run, _, _ = long_run
    text = write_report(run, tmp_path_factory.mktemp("long") / "r.html").read_text(encoding="utf-8")
    return text, embedded_specs(text)


def _heatmap(specs, title_part: str) -> list[dict]:
    spec = next(s for s in specs if title_part in json.dumps(s.get("title", ""), ensure_ascii=False))
    return next(iter(spec["datasets"].values()))


def test_report_bins_long_runs_into_a_pandas_aggregation_and_stays_small(long_report, long_run):
    run, _, _ = long_run
    text, specs = long_report
    width = math.ceil(LONG_STEPS / MAX_STEP_COLUMNS)
    assert width == 3
    # the bound: the page stays small, every heatmap has at most MAX_STEP_COLUMNS columns
    assert len(text.encode("utf-8")) < 1_500_000
    heatmaps = [next(iter(s["datasets"].values())) for s in specs
                if any(p.get("name") == "cell" for p in s.get("params", []))]  # heatmap_chart's selection
    assert len(heatmaps) == 8  # activation ×2, activation_grad ×2, param_grad ×2, weight, loss
    for cells in heatmaps:
        assert len({c["step_lo"] for c in cells}) <= MAX_STEP_COLUMNS
        assert all(c["step_hi"] - c["step_lo"] == width for c in cells)
    # the report says so
    assert "Steps binned:" in text and f"each column spans {width} steps" in text
    # the activation cells are the pandas aggregation of run.tensors: max absmax per module and
    # 3-step bin, log2; the cell's worst step holds that maximum
    t = run.tensors[run.tensors["role"] == "activation"]
    per_step = t.groupby([t["module"].astype(str), "step"], observed=True)["absmax"].max()
    binned = per_step.groupby([per_step.index.get_level_values(0),
                               per_step.index.get_level_values(1) // width * width]).max()
    cells = _heatmap(specs, "activation: log2 absmax")
    assert len(cells) == len(binned) == 4 * math.ceil(LONG_STEPS / width)
    for c in cells:
        want = binned[(c["module"], c["step_lo"])]
        assert 2.0 ** c["value"] == pytest.approx(want, rel=1e-12)
        assert per_step[(c["module"], c["step"])] == want and c["step_lo"] <= c["step"] < c["step_hi"]


def test_gradient_heatmap_shows_the_fraction_below_the_normal_range(long_report, long_run):
    _, _, grads = long_run
    text, specs = long_report
    width = math.ceil(LONG_STEPS / MAX_STEP_COLUMNS)
    # the metric is named in the title and the legend
    title = "activation_grad unscaled: fp16 subnormal or flushed fraction (below the normal range, < 2^-14)"
    spec = next(s for s in specs if json.dumps(s.get("title", ""), ensure_ascii=False).strip('"') == title)
    assert spec["encoding"]["color"]["title"][0] == "fp16_below_normal_frac"
    cells = {c["step_lo"]: c for c in next(iter(spec["datasets"].values())) if c["module"] == "0"}
    # oracle: the gradient PyTorch handed our own hook (float16), against torch.finfo's smallest normal
    tiny = torch.finfo(torch.float16).tiny
    below = []
    for g in grads:
        assert g.dtype == torch.float16
        below.append(int(((g != 0) & (g.abs() < tiny)).sum()) / g.numel())
    assert max(below) > 0.5  # the run is unhealthy in this way: the heatmap must not be blank
    assert len(cells) == math.ceil(LONG_STEPS / width)
    for lo, c in cells.items():
        want = max(below[lo:lo + width])
        assert c["value"] == pytest.approx(want, rel=1e-12, abs=1e-15)
        assert below[c["step"]] == pytest.approx(want, rel=1e-12, abs=1e-15)
    # the flush-to-zero fraction alone is blank here: float16 gradients are never flushed by a cast
    t = long_run[0].tensors
    assert (t.loc[(t["role"] == "activation_grad") & (t["dtype"] == "float16"), "fp16_underflow_frac"] == 0).all()


class Rows(HTMLParser):
    """(class, module, role) of each row of the report's limits table."""

    def __init__(self):
        super().__init__()
        self.rows: list[list] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "tr" and dict(attrs).get("class") in ("alarm", "quiet"):
            self.rows.append([dict(attrs)["class"]])
        elif tag == "td" and self.rows and len(self.rows[-1]) < 3:
            self._cell = []

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self.rows[-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def test_red_rows_are_explained_with_their_threshold(long_report, long_run):
    _, model, _ = long_run
    text, _ = long_report
    p = Rows()
    p.feed(text)
    table = {(m, r): cls for cls, m, r in p.rows}
    # oracle: a cast of each (unchanged, lr 0) weight to float16
    for name in ("0", "2"):
        w = getattr(model, name).weight.detach()
        flushed = bool(((w != 0) & (w.to(torch.float16) == 0)).any())
        overflow = bool(torch.isinf(w.to(torch.float16)).any())
        assert table[(name, "weight")] == ("alarm" if flushed or overflow else "quiet"), name
    assert table[("0", "weight")] == "alarm"  # the 1e-9 element
    # the legend says what red means, with the thresholds torch.finfo gives and their source
    fi = torch.finfo(torch.float16)
    flush = f"2^{int(math.log2(fi.smallest_normal * fi.eps / 2))}"  # half the smallest subnormal: 2^-25
    over = f"{fi.max + fi.eps * 2.0 ** math.floor(math.log2(fi.max)) / 2:.6g}"  # max + ulp(max) / 2 = 65520
    legend = re.search(r"<p class='legend'>(.*?)</p>", text, re.S).group(1)
    plain = re.sub(r"<[^>]+>", "", legend)
    assert "Red left edge" in plain and "threshold: any such element, a fraction above 0" in plain
    assert f"float16: |x| ≤ {flush} rounds to 0, |x| ≥ {over} rounds to inf" in plain
    assert "torch.finfo" in plain
    assert "Weights are float32 parameters, judged in float16 because autocast casts them" in plain
    # the legend sits right under the table it explains
    assert text.index("<p class='legend'>") == text.index("</table>", text.index("Modules nearest")) + len("</table>")
