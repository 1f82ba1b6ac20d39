"""The HTML report as a browser shows it: headless Chromium, driven over the DevTools protocol."""

from __future__ import annotations

import io

from PIL import Image
from reports_testlib import HOSTILE_IMG, HOSTILE_LONG, HOSTILE_SCRIPT, pixel_spread


DOM_QUERIES = ("script", "link", "iframe", "img", "article.finding", "img[onerror]", "[onload]", "[onclick]")


def only_itself(visit, path) -> list[str]:
    """Every request the page made but its own file and its inline (data:) images."""
    return [r for r in visit.requests if not r.startswith("data:image/png;base64,") and r != path.resolve().as_uri()]


def test_report_opens_offline_without_errors_and_shows_every_finding(diverged_built, browser, tmp_path):
    _, findings, _, html, _ = diverged_built
    path = tmp_path / "report.html"
    path.write_text(html, encoding="utf-8")
    visit = browser.visit(path, queries=DOM_QUERIES)
    assert only_itself(visit, path) == []  # no network, no other file
    assert [m for m in visit.console if m[0] in ("error", "warning", "assert")] == []
    assert visit.exceptions == [] and visit.dialogs == []
    assert visit.counts["script"] == visit.counts["link"] == visit.counts["iframe"] == 0
    assert visit.counts["article.finding"] == len(findings)
    assert visit.counts["img"] >= 5 and visit.broken_images == 0
    text = " ".join(visit.text.split())
    for f in findings:
        assert " ".join(f.summary.split()) in text, f.kind
    assert "first to go wrong" in text
    shot = Image.open(io.BytesIO(visit.screenshot))
    assert shot.width == 1200 and shot.height > 3000  # the whole page, figures included
    assert pixel_spread(visit.screenshot) > 20  # not a blank page


def test_hostile_names_render_as_text_and_run_nothing(hostile_built, browser, tmp_path):
    param = f"{HOSTILE_IMG}.weight"
    path = tmp_path / "hostile.html"
    path.write_text(hostile_built[3], encoding="utf-8")
    visit = browser.visit(path, queries=DOM_QUERIES)
    assert visit.dialogs == []  # alert(1) never ran
    assert visit.counts["script"] == 0 and visit.counts["img[onerror]"] == 0 and visit.counts["[onload]"] == 0
    assert only_itself(visit, path) == []  # <img src=x> was never fetched
    for name in (HOSTILE_SCRIPT, param, f"Net{HOSTILE_SCRIPT}", HOSTILE_LONG):
        assert name in visit.text, name
    assert pixel_spread(visit.screenshot) > 20
