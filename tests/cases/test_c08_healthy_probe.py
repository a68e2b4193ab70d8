"""C08: a healthy fp16 run whose GradScaler probes every growth_interval (negative control)."""

import numpy as np

from . import scenarios as S
from .conftest import find


def test_c08_skips_match_gradscaler():
    d = S.c08()
    s = d.run.steps
    assert int(s.skipped.sum()) == d.skipped  # what PyTorch's GradScaler did
    assert np.isfinite(s.loss).all()
    sk = s.step[s.skipped].to_numpy()
    lead = int(np.argmax(np.diff(np.r_[-1, sk]) != 1)) if len(sk) else 0
    assert lead == 4 and len(sk) == 12  # CASES.md: 4 skips at the start, 12 in total
    gaps = np.diff(sk[lead:])
    assert 40 <= np.median(gaps) <= 60  # then about one every growth_interval = 50


def test_c08_no_warning_and_probe_reported_as_normal():
    rec = S.mpscope.advise(S.c08().run)
    assert not [f for f in rec.findings if f.severity in ("warning", "error")], rec.to_text()
    probe = find(rec, "periodic_probe")[0]
    assert probe.severity == "info" and probe.threshold == 1 / 50
    assert 0.5 / 50 < probe.value < 1.5 / 50
