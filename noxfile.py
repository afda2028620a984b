"""nox sessions for the hfexport monorepo (uv backend).

- ``nox -s lint``: ruff lint and format check.
- ``nox -s "tests(package='hfexport-onnx')"``: one package's unit tests in a venv holding only that
  package and its declared dependencies (its ``tested`` extra), which proves it does not lean on
  another workspace member.
- ``nox -s integration``: cross-package tests (``tests-integration/``) on the locked workspace.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "tests", "integration"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
PACKAGES = ["hfexport", "hfexport-dynamo", "hfexport-onnx", "hfexport-executorch"]
PYTHON = "3.11"


def _show_versions(session: nox.Session) -> None:
    session.run("uv", "pip", "list", "--python", session.virtualenv.location, silent=False, external=True)


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole tree."""
    session.run("uv", "run", "--frozen", "ruff", "check", ".", external=True)
    session.run("uv", "run", "--frozen", "ruff", "format", "--check", ".", external=True)


@nox.session(python=PYTHON, tags=["unit"])
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """Unit tests of one package, installed alone with its declared (tested) dependencies."""
    pkg_dir = ROOT / "packages" / package
    extra = "" if package == "hfexport" else "[tested]"
    session.install("pytest>=8")
    # the core from the workspace (not an index), then the package itself
    session.install("-e", str(ROOT / "packages" / "hfexport"))
    if package != "hfexport":
        session.install("-e", f"{pkg_dir}{extra}")
    _show_versions(session)
    session.run("pytest", str(pkg_dir / "tests"), "-q", *session.posargs,
                env={"HFEXPORT_CASES_DIR": os.environ.get("HFEXPORT_CASES_DIR", str(ROOT.parent / "shared" / "cases"))})


@nox.session(python=PYTHON, tags=["integration"])
def integration(session: nox.Session) -> None:
    """Cross-package tests on the locked workspace environment (all backends, tested pins)."""
    session.run_install("uv", "sync", "--frozen", "--python", PYTHON,
                        env={"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}, external=True)
    _show_versions(session)
    session.run("pytest", str(ROOT / "tests-integration"), "-q", *session.posargs)
