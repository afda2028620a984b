"""Every built-in workaround of every kind names its description, upstream issue and version range."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from hfexport import registry, workarounds

BACKEND_PACKAGES = ("hfexport_dynamo", "hfexport_onnx", "hfexport_executorch")
# modules that register entries only when imported (not at package import)
LAZY_MODULES = ("hfexport_executorch.generation",)


def _ours(entry: registry.RegistryEntry) -> bool:
    module = getattr(entry.func, "__module__", "") or ""
    return module.split(".")[0] in ("hfexport", *BACKEND_PACKAGES)


#: Registered ORT fusions that are our own optimizations, not workarounds of an upstream bug: ONNX
#: Runtime's graph optimizers do not pack sibling MatMuls at all (hfexport_onnx.matmul_packing), so
#: there is no issue to name and nothing to retire; they carry a description and versions.
OPTIMIZATIONS = {
    "hfexport_onnx.fusions.fuse_sibling_matmuls_cpu",
    "hfexport_onnx.fusions.fuse_sibling_matmuls_cuda",
}


def missing_metadata(found: list[registry.RegistryEntry]) -> list[str]:
    """``kind backend name: what is missing`` for each of our entries lacking metadata."""
    problems = []
    for entry in found:
        if not _ours(entry):
            continue
        needed = (
            ("description", "versions")
            if entry.name in OPTIMIZATIONS
            else ("description", "issue", "versions")
        )
        lacking = [field for field in needed if not getattr(entry, field)]
        if lacking:
            problems.append(f"{entry.kind} {entry.backend} {entry.name}: no {', '.join(lacking)}")
    return problems


def test_every_builtin_entry_carries_description_issue_and_versions():
    workarounds.load()
    for name in (*BACKEND_PACKAGES, *LAZY_MODULES):
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)
    found = registry.entries()
    assert len([e for e in found if _ours(e)]) >= 15  # the check looked at the real built-ins
    assert {e.kind for e in found if _ours(e)} >= {
        "patch",
        "fx_node_fix",
        "fx_program_fix",
        "onnx_translation",
        "input_preparer",
    }
    assert missing_metadata(found) == []
    for entry in found:
        if _ours(entry) and entry.name not in OPTIMIZATIONS:
            assert entry.issue.startswith("https://github.com/"), entry.name


def test_the_check_catches_an_entry_of_ours_without_metadata():
    def helper_fix(ep):
        return None

    helper_fix.__module__ = "hfexport_onnx.workarounds.fx_fixes"  # as if defined there
    with registry.isolated_registry():
        registry.register_fx_program_fix("onnx")(helper_fix)
        registry.register_fx_program_fix("onnx")(pytest.fail)  # a user's entry: not ours, not checked
        problems = missing_metadata(registry.entries())
    assert problems == [
        "fx_program_fix onnx hfexport_onnx.workarounds.fx_fixes."
        "test_the_check_catches_an_entry_of_ours_without_metadata.<locals>.helper_fix: "
        "no description, issue, versions"
    ]


def test_importing_the_backends_imports_no_transformers_modeling_module():
    """Patch targets resolve lazily: a backend import registers its patches without importing them."""
    import os
    import subprocess
    import sys

    installed = [name for name in BACKEND_PACKAGES if importlib.util.find_spec(name) is not None]
    code = (
        f"import {', '.join(installed)}, sys\n"
        "heavy = sorted(m for m in sys.modules if m == 'transformers.modeling_utils'\n"
        "    or m.startswith(('transformers.integrations.moe', 'transformers.integrations.deepgemm',\n"
        "                     'transformers.integrations.hub_kernels', 'transformers.core_model_loading'))\n"
        "    or (m.startswith('transformers.models.') and '.modeling_' in m))\n"
        "print('HEAVY', heavy)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "HEAVY []" in done.stdout, done.stdout
