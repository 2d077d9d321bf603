"""The documentation: a short README whose links resolve, nothing pointing outside the
repository, reference pages read from the live code (a field added to a settings model shows
in the page; the metrics page lists what ``/metrics`` yields), the benchmarks page rendered from
recorded runs, the site built strictly and drawn by a browser, and the first request's commands
run as written against a stack."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from pydantic import BaseModel, Field

from api.metrics import METRICS, ClusterCollector
from cachesvc.redis_client import open_redis
from config.settings import ApiSettings, Settings
from docsgen.benchmarks import page as benchmarks_page
from docsgen.reference import settings_page
from tests.redis_databases import API_START, on_database
from tests.workers_harness import serve_api
from workers.queue.cluster_view import ClusterView

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_readme_is_a_front_page_whose_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), target
    assert "make up" in readme and "make test" in readme


def test_nothing_in_the_repository_points_outside_it() -> None:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    outside = "../" + "shared"  # spelt apart, so that this file does not point there itself
    pointing = [name for name in tracked
                if (ROOT / name).is_file() and name.endswith((".py", ".md", ".toml", ".yml",
                                                              ".yaml", ".sh"))
                and outside in (ROOT / name).read_text(errors="replace")]
    assert pointing == []


def test_the_settings_page_is_read_from_the_models() -> None:
    class Extra(BaseModel):
        """A section added for the test."""

        # what the comment above a field says
        widgets: int = 3
        gadgets: str = Field("x", description="what a description says")

    class Root(Settings):
        extra: Extra = Extra()

    page = settings_page(Root)
    assert "## extra" in page and "A section added for the test." in page
    assert "| `extra.widgets` | `int` | `3` | `DIFFCACHE_EXTRA__WIDGETS` | what the comment " \
        "above a field says |" in page
    assert "`DIFFCACHE_EXTRA__GADGETS` | what a description says |" in page
    # And the live models' fields, every one of them.
    live = settings_page(Settings)
    for section in ("store", "cache", "model", "workers", "api"):
        model = Settings.model_fields[section].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        for name in model.model_fields:
            assert f"`{section}.{name}`" in live


def test_the_metrics_page_lists_what_a_scrape_yields(workerless_stack: Settings) -> None:
    client: redis.Redis = open_redis(on_database(workerless_stack, API_START))
    scraped = {family.name for family in ClusterCollector(ClusterView(client)).collect()}
    assert scraped == {m.name for m in METRICS}


def test_the_benchmarks_page_renders_recorded_runs(tmp_path: Path) -> None:
    runs = [{"date": f"2026-12-0{n}", "commit": f"abc{n}", "machine": "AMD EPYC, 2 cores",
             "bench": "batching", "throughput_ratio_8": 3.0 + n / 10, "identical": True,
             "rps": {"1": 1.2}} for n in (1, 2)]
    (tmp_path / "batching.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    markdown, plots = benchmarks_page(tmp_path)
    assert "## batching" in markdown and "`python -m bench.batching`" in markdown
    assert "2026-12-02, commit `abc2`, AMD EPYC, 2 cores" in markdown
    assert "| `throughput_ratio_8` | 3.2 |" in markdown and "2 recorded run(s)" in markdown
    assert set(plots) == {"plots/batching-throughput_ratio_8.svg"}
    assert plots["plots/batching-throughput_ratio_8.svg"].count("<circle") == 2
    assert "(plots/batching-throughput_ratio_8.svg)" in markdown


def test_every_recorded_bench_has_its_latest_run_here() -> None:
    results = ROOT / "bench" / "results"
    for name in ("e2e", "batching", "dispatch", "step_cache", "compose"):
        runs = [json.loads(line) for line in (results / f"{name}.jsonl").read_text()
                .splitlines()]
        assert runs and {"date", "commit", "machine", "bench"} <= set(runs[-1]), name


@pytest.mark.slow  # builds the site, then starts a browser
def test_the_site_builds_strictly_and_a_browser_draws_it(tmp_path: Path) -> None:
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                    "--site-dir", str(site)], cwd=ROOT, check=True, timeout=600)
    for page in ("index.html", "reference/settings/index.html", "reference/cli/index.html",
                 "reference/rest/index.html", "reference/metrics/index.html",
                 "benchmarks/index.html"):
        assert (site / page).exists(), page
    assert "DIFFCACHE_WORKERS__MAX_BATCH" in (site / "reference/settings/index.html").read_text()
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--window-size=1200,900",
             f"--user-data-dir={tmp_path / 'profile'}"]
    for page in ("index.html", "benchmarks/index.html"):
        shot = tmp_path / f"{page.replace('/', '-')}.png"
        subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", (site / page).as_uri()],
                       capture_output=True, timeout=120, check=True)
        assert shot.stat().st_size > 10_000, page


@pytest.mark.slow  # a stack with workers
def test_the_first_requests_commands_run_as_written(worker_settings: Settings, pool: object,
                                                    tmp_path: Path) -> None:
    page = (ROOT / "docs" / "getting-started" / "first-request.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", page, re.S)
    curl = next(b for b in blocks if "until curl" in b)  # the whole exchange
    with serve_api(worker_settings, ApiSettings()) as url:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c",
                               curl.replace("localhost:8000", url)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "circle.png").stat().st_size > 0
