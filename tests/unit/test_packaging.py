"""What the wheel ships: every package of the checkout, and the report's template inside harness/templates/."""

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from harness.report import page as report

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "run_tiny.json"


def setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_in_the_checkout_is_listed():
    """pyproject.toml lists its packages (discovery cannot map templates/): a folder of Python files not listed
    there would be missing from the wheel."""
    listed = set(setuptools_config()["packages"])
    tops = {name.split(".")[0] for name in listed}
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in tops for p in (ROOT / top).rglob("*.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_the_template_package_maps_onto_the_top_level_folder():
    cfg = setuptools_config()
    assert cfg["package-dir"]["harness.templates"] == "templates"
    assert "*.j2" in cfg["package-data"]["harness.templates"]
    template = report.TEMPLATES / "report.html.j2"
    assert template.is_file() and Path(str(template)).resolve() == ROOT / "templates" / "report.html.j2"
    assert "Content-Security-Policy" in template.read_text(encoding="utf-8")


def copy_sources(dst: Path) -> None:
    """What the build reads, outside the checkout: an in-tree build would leave build/ there for every worker."""
    cfg = setuptools_config()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dst / name)
    for folder in {p.split(".")[0] for p in cfg["packages"]} | set(cfg["package-dir"].values()):
        shutil.copytree(ROOT / folder, dst / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))


def test_the_wheel_ships_the_template_and_the_report_loads_it_from_there(tmp_path):
    src, dist, site = tmp_path / "src", tmp_path / "dist", tmp_path / "site"
    src.mkdir()
    copy_sources(src)
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(src),
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(dist),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    hint = "pip wheel failed (the test extra brings the setuptools it needs: pip install -e '.[test]')"
    assert build.returncode == 0, f"{hint}:\n{build.stderr[-3000:]}"
    (wheel,) = dist.glob("engine_harness-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(site)  # a pure-Python wheel installs as exactly these files
    assert "harness/templates/report.html.j2" in names and "engine/synth/corpus.txt" in names
    assert not any(n.startswith("templates/") for n in names)  # no top-level package named templates
    # The unpacked wheel first on the path (its dependencies come from this environment's site-packages).
    probe = (
        f"import sys; sys.path.insert(0, {str(site)!r})\n"
        "from pathlib import Path\n"
        "from harness.report import page as report\n"
        "print(report.TEMPLATES / 'report.html.j2')\n"
        f"print(len(report.render_html(report.build_view(report.load([Path({str(FIXTURE)!r})])))))\n"
    )
    run = subprocess.run(
        [sys.executable, "-I", "-c", probe], check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    template, html_chars = run.stdout.split()
    assert Path(template) == site / "harness" / "templates" / "report.html.j2"
    assert int(html_chars) > 10_000
