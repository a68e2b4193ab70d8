"""The standalone HTML report: self-contained (no network), escaped, and showing the run's numbers."""

from __future__ import annotations

import json
import math
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import mpscope
from loops import record_fp16

alt = pytest.importorskip("altair")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("vl_convert")

from mpscope.report import write_report  # noqa: E402

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
    assert "vegaEmbed" in p.scripts[1]
    # the escaped name is visible as text (the HTML parser unescapes it back)
    assert EVIL in "".join(p.text)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    # chart specs: valid JSON with the name escaped for the script context and the data inlined
    m = re.search(r"const mpscopeSpecs = (\[.*\]);\nmpscopeSpecs", p.scripts[1], re.S)
    specs = json.loads(m.group(1))
    assert "\\u003cscript\\u003e" in m.group(1)
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
    specs = json.loads(re.search(r"const mpscopeSpecs = (\[.*\]);\nmpscopeSpecs", text, re.S).group(1))
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
    text = rec.run.report(tmp_path / "r.html").read_text()
    fi = torch.finfo(torch.bfloat16)
    bf16 = f"bf16 min subnormal 2^{int(math.log2(fi.smallest_normal * fi.eps))}"  # 2^-133
    fp16 = f"fp16 max {torch.finfo(torch.float16).max:.6g}"
    assert (bf16 in text, fp16 in text) == ((True, False) if dtype == torch.bfloat16 else (False, True))
