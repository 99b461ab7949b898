"""Measure what a visitor waits for, in a real browser: cold start and Run -> first token.

    .venv/bin/python scripts/measure_latency.py [--runs 3] [--json]

1. Cold start: starts `python app.py` (model cache already built, nothing loaded), opens the
   page in headless Chromium as soon as the server answers, presses Run and waits for the
   first live token: seconds from the process start.
2. Warm: presses Run again `--runs` times (model loaded) and reports the seconds from the
   click to the first streamed token of each run (median and all).
The prompt is the page's default; the drafter is the page's default. Needs Debian's chromium
at /usr/bin/chromium and playwright (both installed by `make test`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
FIRST_LIVE_TOKEN = (
    "() => document.querySelector('#sl-stats .sl-badge-running') !== null && "
    "document.querySelectorAll('#sl-output .sl-tok').length > 0"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_server(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"the app did not answer at {url}")


STARTS: list[float] = []  # seconds from each click to the "running" badge (the run's start event shown)


def click_run_and_wait(page) -> float:
    """Seconds from the Run click to the first live token (then waits for the run to end)."""
    page.wait_for_function("() => !document.querySelector('#sl-run').disabled", timeout=300_000)
    started = time.monotonic()
    page.locator("#sl-run").click()
    page.wait_for_selector("#sl-stats .sl-badge-running", timeout=300_000)
    STARTS.append(time.monotonic() - started)
    page.wait_for_function(FIRST_LIVE_TOKEN, timeout=300_000, polling=10)
    first = time.monotonic() - started
    page.wait_for_selector("#sl-stats .sl-badge-finished", timeout=300_000)
    return first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    env = dict(os.environ, GRADIO_SERVER_PORT=str(port), HF_HUB_OFFLINE="1")
    t0 = time.monotonic()
    server = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    try:
        wait_for_server(url, t0 + 120)
        serving = time.monotonic() - t0
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page()
            page.goto(url, wait_until="domcontentloaded")
            page.wait_for_selector("#sl-output .sl-tok", timeout=120_000)  # recorded trace shown
            page_ready = time.monotonic() - t0
            page.locator("#sl-max-new input[type=number]").fill("8")
            page.locator("#sl-max-new input[type=number]").press("Enter")
            clicked = time.monotonic() - t0
            cold = clicked + click_run_and_wait(page)
            warm = [click_run_and_wait(page) for _ in range(args.runs)]
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    report = {
        "server_answering_s": round(serving, 2),
        "page_ready_s": round(page_ready, 2),
        "cold_start_to_first_token_s": round(cold, 2),
        "run_to_first_token_s": [round(w, 3) for w in warm],
        "run_to_first_token_median_s": round(statistics.median(warm), 3),
        "run_to_running_badge_s": [round(t, 3) for t in STARTS],
    }
    print(json.dumps(report, indent=2) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
