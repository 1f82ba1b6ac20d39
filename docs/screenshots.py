"""Screenshots of the reports of three sample traces (a NaN, an explosion, a healthy run), as a
user sees them: the HTML's first screen and whole page at 1280 px in headless Chromium, and the
PDF's pages rendered by pdftoppm. For looking at the reports after a change to them, and for the
README's picture (``--readme`` writes docs/report.png, the first screen of the NaN's report).

    python docs/screenshots.py OUT_DIR [--readme]

Needs the analyzer installed (``pip install .``), ``chromium`` and ``pdftoppm`` (poppler-utils).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = ("nan_birth", "exploding_lr", "healthy_mlp")
WIDTH, FIRST_SCREEN = 1280, 900


def _chromium() -> str:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    sys.exit("screenshots.py: no chromium found (apt-get install chromium, or set CHROMIUM)")


def _screenshot(chromium: str, html: str, png: str, height: int) -> None:
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={WIDTH},{height}", f"--screenshot={png}", f"file://{html}"],
                   check=True, capture_output=True, timeout=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="folder for the reports and their pictures")
    ap.add_argument("--readme", action="store_true", help="also write docs/report.png")
    args = ap.parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    chromium = _chromium()
    if not shutil.which("pdftoppm"):
        sys.exit("screenshots.py: no pdftoppm found (apt-get install poppler-utils)")
    for name in SAMPLES:
        html, pdf = os.path.join(out, f"{name}.html"), os.path.join(out, f"{name}.pdf")
        # Run from the repository, so the report names the sample as a user's command does.
        done = subprocess.run([sys.executable, "-m", "torchautopsy", "analyze", f"sample_traces/{name}",
                               "--html", html, "--pdf", pdf, "--md", os.path.join(out, f"{name}.md")],
                              capture_output=True, text=True, cwd=ROOT)
        if done.returncode not in (0, 1):
            sys.exit(f"screenshots.py: analyze {name} failed: {done.stderr.strip()}")
        _screenshot(chromium, html, os.path.join(out, f"{name}.first.png"), FIRST_SCREEN)
        _screenshot(chromium, html, os.path.join(out, f"{name}.page.png"), 8000)
        subprocess.run(["pdftoppm", "-r", "50", "-png", pdf, os.path.join(out, f"{name}.pdf")], check=True)
        print(f"{name}: {out}/{name}.first.png, .page.png, .pdf-N.png")
    if args.readme:
        shutil.copyfile(os.path.join(out, "nan_birth.first.png"), os.path.join(ROOT, "docs", "report.png"))
        print(f"wrote {os.path.join(ROOT, 'docs', 'report.png')}")


if __name__ == "__main__":
    main()
