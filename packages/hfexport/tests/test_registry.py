"""Tests for hfexport.registry: patches, FX fixes, scopes, version gating, staleness."""

from __future__ import annotations

import importlib
import logging
import sys
import textwrap
import threading
import types

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from hfexport import registry
from hfexport.registry import (
    apply_fx_node_fixes,
    apply_fx_program_fixes,
    apply_patches,
    entries,
    installed_version,
    isolated_registry,
    register_fx_node_fix,
    register_fx_program_fix,
    register_patch,
)

ISSUE = "https://github.com/pytorch/pytorch/issues/1"
ANY_TORCH = {"torch": ">=2"}
MOD = "_hfexport_regtest_target"
aten = torch.ops.aten


def meta(**overrides: object) -> dict[str, object]:
    """Metadata keyword arguments for a decorator, active with the installed torch."""
    base: dict[str, object] = {"description": "test workaround", "issue": ISSUE, "versions": ANY_TORCH}
    base.update(overrides)
    return base


class Widget:
    factor = 3

    def value(self) -> int:
        return 1

    @staticmethod
    def scale(x: int) -> int:
        return x * 2

    @classmethod
    def make(cls) -> str:
        return cls.__name__


class SubWidget(Widget):
    pass


def _double(x: int) -> int:
    return 2 * x


@pytest.fixture
def target(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A throwaway module holding a function and a class hierarchy, registered in sys.modules."""
    mod = types.ModuleType(MOD)
    # fresh classes per test so patches can never leak between tests
    widget = type(
        "Widget", (), {k: v for k, v in Widget.__dict__.items() if k not in ("__dict__", "__weakref__")}
    )
    mod.Widget = widget
    mod.SubWidget = type("SubWidget", (widget,), {})
    mod.double = _double
    monkeypatch.setitem(sys.modules, MOD, mod)
    return mod


@pytest.fixture(autouse=True)
def clean_registry():
    with isolated_registry():
        yield
    assert not registry._INSTALLED


def tag(label: str, calls: list[str] | None = None):
    """A patch factory whose replacement records ``label`` and adds 100 to the result."""

    def factory(original):
        if calls is not None:
            calls.append(f"factory:{label}")

        def replacement(*args, **kwargs):
            if calls is not None:
                calls.append(label)
            return original(*args, **kwargs) + 100

        return replacement

    factory.__qualname__ = f"tag_{label}"
    return factory


# ------------------------------------------------------------------------------------------
# installing and restoring
# ------------------------------------------------------------------------------------------


def test_patch_installed_inside_and_identical_originals_restored(target):
    raw = dict(target.Widget.__dict__)
    orig_double = target.double
    register_patch(
        "onnx", f"{MOD}.double", f"{MOD}.Widget.value", f"{MOD}.Widget.scale", f"{MOD}.Widget.make", **meta()
    )(tag("p"))
    with apply_patches("onnx") as applied:
        assert [e.name for e in applied] == [f"{__name__}.tag_p"]
        assert target.double(4) == 108
        assert target.Widget().value() == 101
        # staticmethod stays static: works through the class and through an instance
        assert isinstance(target.Widget.__dict__["scale"], staticmethod)
        assert target.Widget.scale(5) == 110
        assert target.Widget().scale(5) == 110
        # classmethod stays a classmethod: a subclass still binds itself
        assert isinstance(target.Widget.__dict__["make"], classmethod)
    assert target.double is orig_double
    for name in ("value", "scale", "make"):
        assert target.Widget.__dict__[name] is raw[name]
    assert target.Widget.scale(5) == 10
    assert target.Widget().value() == 1


def test_classmethod_patch_binds_subclass(target):
    def factory(original):
        def make(cls):
            return "patched-" + original(cls)

        return make

    register_patch("onnx", f"{MOD}.Widget.make", **meta())(factory)
    with apply_patches("onnx"):
        assert target.Widget.make() == "patched-Widget"
        assert target.SubWidget.make() == "patched-SubWidget"
        assert target.SubWidget().make() == "patched-SubWidget"
    assert target.SubWidget.make() == "SubWidget"


def test_inherited_attribute_is_deleted_again_not_copied(target):
    register_patch("onnx", f"{MOD}.SubWidget.value", **meta())(tag("sub"))
    assert "value" not in target.SubWidget.__dict__
    with apply_patches("onnx"):
        assert target.SubWidget().value() == 101
        assert target.Widget().value() == 1  # the base class is untouched
    assert "value" not in target.SubWidget.__dict__
    assert target.SubWidget().value() == 1


def test_real_torch_target_patched_and_restored():
    original = F.gelu
    register_patch("dynamo", "torch.nn.functional.gelu", **meta())(tag("gelu"))
    x = torch.tensor([-1.0, 0.0, 2.0])
    with apply_patches("dynamo"):
        assert F.gelu is not original
        torch.testing.assert_close(F.gelu(x), original(x) + 100)
    assert F.gelu is original
    assert torch.nn.functional.__dict__["gelu"] is original


def test_restored_when_body_raises(target):
    orig = target.double
    raw_scale = target.Widget.__dict__["scale"]
    register_patch("onnx", f"{MOD}.double", f"{MOD}.Widget.scale", **meta())(tag("boom"))
    with pytest.raises(RuntimeError, match="inside"), apply_patches("onnx"):
        assert target.double(1) == 102
        raise RuntimeError("inside")
    assert target.double is orig
    assert target.Widget.__dict__["scale"] is raw_scale


def test_factory_error_rolls_back_earlier_patches(target):
    orig = target.double
    register_patch("onnx", f"{MOD}.double", **meta())(tag("first"))

    def broken(original):
        raise KeyError("no luck")

    register_patch("onnx", f"{MOD}.Widget.value", **meta())(broken)
    with pytest.raises(KeyError) as info, apply_patches("onnx"):
        pytest.fail("body must not run")
    assert any("broken" in note and f"{MOD}.Widget.value" in note for note in info.value.__notes__)
    assert target.double is orig
    assert "value" in target.Widget.__dict__ and target.Widget().value() == 1


# ------------------------------------------------------------------------------------------
# nesting, threads, scopes
# ------------------------------------------------------------------------------------------


def test_nested_same_key_does_not_double_wrap(target):
    calls: list[str] = []
    orig = target.double
    register_patch("onnx", f"{MOD}.double", **meta())(tag("n", calls))
    with apply_patches("onnx") as outer:
        with apply_patches("onnx") as inner:
            assert [e.name for e in inner] == [e.name for e in outer]
            assert target.double(1) == 102  # wrapped once: +100, not +200
        assert target.double(1) == 102  # the inner exit left the outer patch alone
    assert calls == ["factory:n", "n", "n"]
    assert target.double is orig


def test_nested_two_keys_and_parent_scope(target):
    calls: list[str] = []
    register_patch("onnx", f"{MOD}.double", **meta())(tag("onnx", calls))
    register_patch("executorch", f"{MOD}.Widget.value", **meta())(tag("et", calls))
    register_patch("executorch.xnnpack", f"{MOD}.Widget.scale", **meta())(tag("xnn", calls))
    with apply_patches("onnx"):
        with apply_patches("executorch"):
            with apply_patches("executorch.xnnpack") as applied:
                assert [e.name for e in applied] == [f"{__name__}.tag_et", f"{__name__}.tag_xnn"]
                assert (target.double(1), target.Widget().value(), target.Widget.scale(1)) == (102, 101, 102)
            assert target.Widget.scale(1) == 2
            assert target.Widget().value() == 101
        assert target.Widget().value() == 1
        assert target.double(1) == 102
    assert target.double(1) == 2
    # each factory ran once although "executorch" was asked for twice
    assert [c for c in calls if c.startswith("factory:")] == ["factory:onnx", "factory:et", "factory:xnn"]


def test_scoped_keys_select_parents_not_siblings(target):
    register_patch("executorch", f"{MOD}.double", **meta())(tag("et"))
    register_patch("executorch.xnnpack", f"{MOD}.double", **meta())(tag("xnn"))
    register_patch("executorch.cuda", f"{MOD}.double", **meta())(tag("cuda"))
    register_patch("executor", f"{MOD}.double", **meta())(tag("prefix_trap"))

    def names(key: str) -> list[str]:
        with apply_patches(key) as applied:
            result = target.double(1)
        return [e.name.rsplit(".", 1)[1] for e in applied] + [str(result)]

    assert names("executorch") == ["tag_et", "102"]
    assert names("executorch.xnnpack") == ["tag_et", "tag_xnn", "202"]
    assert names("executorch.cuda") == ["tag_et", "tag_cuda", "202"]
    assert names("executor") == ["tag_prefix_trap", "102"]
    assert target.double(1) == 2


def test_parent_patch_installed_before_scoped_one(target):
    order: list[str] = []
    register_patch("executorch.xnnpack", f"{MOD}.double", **meta())(tag("xnn", order))
    register_patch("executorch", f"{MOD}.double", **meta())(tag("et", order))
    with apply_patches("executorch.xnnpack"):
        target.double(1)
    # the parent factory wraps the original; the scoped one wraps the parent's replacement
    assert order == ["factory:et", "factory:xnn", "xnn", "et"]


def test_second_thread_waits_until_first_block_exits(target):
    register_patch("onnx", f"{MOD}.double", **meta())(tag("t"))
    events: list[str] = []
    a_inside = threading.Event()
    a_release = threading.Event()
    b_started = threading.Event()
    results: dict[str, int] = {}

    def thread_a() -> None:
        with apply_patches("onnx"):
            events.append("A enter")
            a_inside.set()
            assert a_release.wait(10)
            results["A"] = target.double(1)
            events.append("A exit")

    def thread_b() -> None:
        assert a_inside.wait(10)
        b_started.set()
        with apply_patches("onnx"):
            events.append("B enter")
            results["B"] = target.double(1)
            events.append("B exit")

    ta, tb = threading.Thread(target=thread_a), threading.Thread(target=thread_b)
    ta.start()
    tb.start()
    assert b_started.wait(10)
    tb.join(0.3)  # B is blocked on the lock while A is inside
    assert tb.is_alive()
    assert events == ["A enter"]
    a_release.set()
    ta.join(10)
    tb.join(10)
    assert events == ["A enter", "A exit", "B enter", "B exit"]
    assert results == {"A": 102, "B": 102}
    assert target.double(1) == 2


# ------------------------------------------------------------------------------------------
# resolution, validation, idempotence
# ------------------------------------------------------------------------------------------


def test_unresolvable_paths_recorded_and_skipped(target, caplog):
    register_patch(
        "onnx",
        "_hfexport_no_such_pkg.sub.fn",
        f"{MOD}.Widget.nope",
        f"{MOD}.double",
        **meta(),
    )(tag("partial"))
    (entry,) = entries("onnx")
    assert entry.paths == ("_hfexport_no_such_pkg.sub.fn", f"{MOD}.Widget.nope", f"{MOD}.double")
    reasons = dict(entry.unresolved)
    assert list(reasons) == ["_hfexport_no_such_pkg.sub.fn", f"{MOD}.Widget.nope"]
    assert "_hfexport_no_such_pkg" in reasons["_hfexport_no_such_pkg.sub.fn"]
    assert "no attribute 'nope'" in reasons[f"{MOD}.Widget.nope"]
    with caplog.at_level(logging.WARNING, logger="hfexport.registry"):
        for _ in range(2):
            with apply_patches("onnx"):
                assert target.double(1) == 102  # the resolvable path is still patched
    warnings = [r.getMessage() for r in caplog.records if "cannot replace" in r.getMessage()]
    assert len(warnings) == 2  # one per unresolved path, given once, not per apply
    assert not hasattr(target.Widget, "nope")


def test_module_with_unresolvable_patch_imports_and_reload_replaces(tmp_path, monkeypatch):
    source = textwrap.dedent(
        f"""
        from hfexport.registry import register_patch

        @register_patch(
            "onnx",
            "_hfexport_no_such_pkg.attention.sdpa",
            description="{{desc}}",
            issue="{ISSUE}",
            versions={{"torch": "<99"}},
        )
        def fix_sdpa(original):
            return original
        """
    )
    (tmp_path / "_hfexport_regtest_plugin.py").write_text(source.replace("{desc}", "first"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "_hfexport_regtest_plugin", raising=False)
    module = importlib.import_module("_hfexport_regtest_plugin")
    assert callable(module.fix_sdpa)
    (tmp_path / "_hfexport_regtest_plugin.py").write_text(source.replace("{desc}", "second"))
    importlib.invalidate_caches()
    importlib.reload(module)
    sys.modules.pop("_hfexport_regtest_plugin", None)
    found = entries()
    assert [(e.name, e.description) for e in found] == [("_hfexport_regtest_plugin.fix_sdpa", "second")]
    assert found[0].unresolved[0][0] == "_hfexport_no_such_pkg.attention.sdpa"


def test_reregistration_replaces_and_keeps_order(target):
    def first(original):
        return original

    def second(original):
        return original

    register_patch("onnx", f"{MOD}.double", **meta(description="one"))(first)
    register_patch("onnx", f"{MOD}.double", **meta(description="two"))(second)
    register_patch("onnx", f"{MOD}.double", **meta(description="one again"))(first)
    register_fx_node_fix("onnx", **meta())(first)  # another kind is another entry
    assert [(e.kind, e.name.rsplit(".", 1)[1], e.description) for e in entries()] == [
        ("patch", "first", "one again"),
        ("patch", "second", "two"),
        ("fx_node_fix", "first", "test workaround"),
    ]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"issue": ""}, "issue"),
        ({"issue": "#1234"}, "issue"),
        ({"issue": "github.com/pytorch/pytorch/issues/1"}, "issue"),
        ({"versions": {}}, "versions"),
        ({"versions": {"torch": ""}}, "versions"),
        ({"versions": {"torch": "less than 2.14"}}, "specifier"),
        ({"description": ""}, "description"),
        ({"description": "two\nlines"}, "description"),
    ],
)
def test_bad_metadata_raises_value_error(overrides, match):
    for decorate in (
        lambda: register_patch("onnx", f"{MOD}.double", **meta(**overrides)),
        lambda: register_fx_node_fix("onnx", **meta(**overrides)),
        lambda: register_fx_program_fix("onnx", **meta(**overrides)),
    ):
        with pytest.raises(ValueError, match=match):
            decorate()
    assert entries() == []


@pytest.mark.parametrize("backend", ["", "onnx.", ".onnx", "executorch..xnnpack", "on nx"])
def test_bad_backend_raises_value_error(backend):
    with pytest.raises(ValueError, match="backend"):
        register_fx_program_fix(backend, **meta())
    with pytest.raises(ValueError, match="backend"), apply_patches(backend):
        pass


def test_bad_patch_paths_raise_value_error():
    with pytest.raises(ValueError, match="at least one"):
        register_patch("onnx", **meta())
    with pytest.raises(ValueError, match=r"package\.module\.attribute"):
        register_patch("onnx", "gelu", **meta())
    with pytest.raises(ValueError, match=r"package\.module\.attribute"):
        register_patch("onnx", "torch..gelu", **meta())


def test_documented_form_without_metadata_registers_and_applies(target):
    """The reference API's calls, no keywords: registered, always active, never stale."""
    register_patch("onnx", f"{MOD}.double")(tag("plain"))

    @register_fx_node_fix("onnx")
    def node_fix(gm, node):
        return False

    @register_fx_program_fix("executorch")
    def program_fix(ep):
        return None

    found = entries()
    assert [(e.kind, e.backend) for e in found] == [
        ("patch", "onnx"),
        ("fx_node_fix", "onnx"),
        ("fx_program_fix", "executorch"),
    ]
    for entry in found:
        assert (entry.description, entry.issue, entry.versions) == (None, None, {})
        assert entry.issue_text == "no upstream issue recorded" and not entry.has_metadata
        assert entry.is_active() and not entry.is_stale({"torch": ">=2.12"})
    with apply_patches("onnx"):
        assert target.double(1) == 102
    assert target.double(1) == 2


def test_partial_metadata_is_checked_where_given():
    register_fx_node_fix("onnx", description="d", versions=ANY_TORCH)(lambda gm, n: False)
    (entry,) = entries()
    assert (entry.description, entry.issue, entry.versions) == ("d", None, ANY_TORCH)
    with pytest.raises(ValueError, match="issue"):
        register_fx_node_fix("onnx", issue="not a url")


def test_patch_paths_are_resolved_lazily(monkeypatch, tmp_path):
    """Registering imports nothing; the first apply (or listing) resolves and reports failures."""
    pkg = tmp_path / "_hfexport_lazy_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "heavy.py").write_text("def fn(x):\n    return x\n")
    (pkg / "broken.py").write_text("raise RuntimeError('importing me fails')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("_hfexport_lazy_pkg", "_hfexport_lazy_pkg.heavy", "_hfexport_lazy_pkg.broken"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    register_patch("onnx", "_hfexport_lazy_pkg.heavy.fn", **meta())(tag("lazy"))
    register_patch("onnx", "_hfexport_lazy_pkg.broken.fn", **meta())(tag("broken"))
    assert "_hfexport_lazy_pkg.heavy" not in sys.modules  # nothing imported at decoration
    assert "_hfexport_lazy_pkg.broken" not in sys.modules
    with apply_patches("onnx"):
        heavy = sys.modules["_hfexport_lazy_pkg.heavy"]
        assert heavy.fn(1) == 101
    assert heavy.fn(1) == 1
    lazy, broken = entries("onnx")
    assert lazy.unresolved == ()
    ((path, reason),) = broken.unresolved
    assert path == "_hfexport_lazy_pkg.broken.fn"
    assert reason == "importing _hfexport_lazy_pkg.broken failed: RuntimeError: importing me fails"


def test_listing_resolves_without_applying(monkeypatch):
    monkeypatch.delitem(sys.modules, "_hfexport_never_importable", raising=False)
    register_patch("dynamo", "_hfexport_never_importable.mod.fn", **meta())(tag("never"))
    (entry,) = entries("dynamo")
    assert entry.paths == ("_hfexport_never_importable.mod.fn",)
    ((path, reason),) = entry.unresolved
    assert path == "_hfexport_never_importable.mod.fn"
    assert "No module named '_hfexport_never_importable'" in reason


def test_open_kinds_registered_listed_and_applied_by_their_owner():
    kind = registry.register_kind(
        "demo_rewrite", description="a kind a backend applies itself", targets="ops"
    )
    assert kind in registry.kinds()
    assert [k.name for k in registry.kinds()][:3] == ["patch", "fx_node_fix", "fx_program_fix"]

    @registry.register("demo_rewrite", "mybackend.cpu", "aten::erf", **meta())
    def rewrite_erf(x):
        return x + 1

    (entry,) = entries("mybackend.cpu", kind="demo_rewrite")
    assert entry.kind == "demo_rewrite" and entry.targets == ("aten::erf",) and entry.paths == ()
    assert [e.func(1) for e in registry.active_entries("demo_rewrite", "mybackend.cpu")] == [2]
    assert registry.active_entries("demo_rewrite", "mybackend") == []  # a child scope is not a parent
    assert registry.backend_keys() == ["mybackend", "mybackend.cpu"]
    with pytest.raises(ValueError, match="register_kind"):
        registry.register("no_such_kind", "onnx")
    with pytest.raises(ValueError, match="kind name"):
        registry.register_kind("Bad Kind", description="x")


# ------------------------------------------------------------------------------------------
# version gating
# ------------------------------------------------------------------------------------------


def fake_versions(monkeypatch: pytest.MonkeyPatch, **found: str | None) -> None:
    table = {k.replace("_", "-"): v for k, v in found.items()}
    monkeypatch.setattr(registry, "installed_version", lambda dist: table.get(dist))


def test_installed_version_reads_metadata():
    assert installed_version("torch") == importlib.metadata.version("torch")
    assert installed_version("hfexport-surely-not-installed-dist") is None


def test_inactive_range_is_not_installed(target, monkeypatch):
    register_patch("onnx", f"{MOD}.double", **meta(versions={"torch": "<2.14"}))(tag("old"))
    register_patch("onnx", f"{MOD}.Widget.value", **meta(versions={"torch": ">=2", "onnxscript": "<1"}))(
        tag("needs_onnxscript")
    )
    fake_versions(monkeypatch, torch="2.15.0")  # onnxscript absent
    with apply_patches("onnx") as applied:
        assert applied == []
        assert target.double(1) == 2 and target.Widget().value() == 1
    assert [e.inactive_reason() for e in entries()] == [
        "torch 2.15.0 is outside '<2.14'",
        "onnxscript is not installed",
    ]
    fake_versions(monkeypatch, torch="2.13.1", onnxscript="0.7.2")
    with apply_patches("onnx") as applied:
        assert len(applied) == 2
        assert target.double(1) == 102 and target.Widget().value() == 101


@pytest.mark.parametrize(
    ("installed", "spec", "active"),
    [
        ("2.13.0+cpu", "<2.14", True),
        ("2.13.0+cpu", "==2.13.0", True),
        ("2.13.0+cu126", ">=2.13,<2.14", True),
        ("2.14.0+cpu", "<2.14", False),
        ("2.14.0.dev20260101+cpu", "<2.14", False),
        ("2.14.0rc1", ">=2.14.0rc1", True),
        ("not-a-version", ">=0", False),
    ],
)
def test_local_suffix_ignored(monkeypatch, installed, spec, active):
    fake_versions(monkeypatch, torch=installed)
    fix = register_fx_program_fix("dynamo", **meta(versions={"torch": spec}))

    @fix
    def program_fix(ep):
        return None

    (entry,) = entries()
    assert entry.is_active() is active


# ------------------------------------------------------------------------------------------
# FX fixes
# ------------------------------------------------------------------------------------------


def _add_with_unused_mul(x, y):
    _ = x * 2  # unused: dead code elimination must drop it after a fix touched the graph
    return x + y


def test_node_fix_consumes_node_and_later_fix_skips_it():
    x, y = torch.tensor([5.0, 7.0]), torch.tensor([1.0, 2.0])
    gm = make_fx(_add_with_unused_mul)(x, y)
    assert {n.target for n in gm.graph.nodes if n.op == "call_function"} == {aten.mul.Tensor, aten.add.Tensor}
    seen_by_second: list[object] = []

    @register_fx_node_fix("dynamo", **meta())
    def add_to_sub(gm, node):
        if node.target is aten.add.Tensor:
            node.target = aten.sub.Tensor
            return True
        return False

    @register_fx_node_fix("dynamo", **meta())
    def observe(gm, node):
        seen_by_second.append(node.target)
        return False

    assert apply_fx_node_fixes("dynamo", gm) == [f"{__name__}.{add_to_sub.__qualname__}"]
    assert seen_by_second == [aten.mul.Tensor]  # the consumed add never reached the second fix
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == [aten.sub.Tensor]  # the unused mul was eliminated
    torch.testing.assert_close(gm(x, y), torch.tensor([4.0, 5.0]))
    assert "sub" in gm.code and "mul" not in gm.code


def test_node_erased_by_an_earlier_visit_is_not_offered():
    def f(x):
        a = x + 1
        b = a * 3
        return b - 2

    gm = make_fx(f)(torch.ones(2))
    offered: list[object] = []

    @register_fx_node_fix("onnx", **meta())
    def fold_add_mul(gm, node):
        offered.append(node.target)
        if node.target is aten.add.Tensor:
            (mul,) = node.users
            with gm.graph.inserting_after(mul):
                repl = gm.graph.call_function(aten.mul.Tensor, (node.args[0], 6))
            mul.replace_all_uses_with(repl)
            gm.graph.erase_node(mul)
            return True
        return False

    assert apply_fx_node_fixes("onnx", gm) == [f"{__name__}.{fold_add_mul.__qualname__}"]
    # the original mul was erased before its turn came; the new mul is not visited
    assert offered == [aten.add.Tensor, aten.sub.Tensor]
    torch.testing.assert_close(gm(torch.tensor([1.0, 2.0])), torch.tensor([4.0, 10.0]))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [aten.mul.Tensor, aten.sub.Tensor]


class _Inner(torch.nn.Module):
    def forward(self, x):
        return torch.add(x, 1)


class _Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.fx.symbolic_trace(_Inner())

    def forward(self, x):
        return self.inner(x) * torch.add(x, 10)


class _KeepGraphModules(torch.fx.Tracer):
    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return isinstance(m, torch.fx.GraphModule) or super().is_leaf_module(m, qualname)


def test_node_fixes_reach_sub_graph_modules():
    outer = _Outer()
    gm = torch.fx.GraphModule(outer, _KeepGraphModules().trace(outer))
    assert isinstance(gm.inner, torch.fx.GraphModule)
    visited: list[tuple[str, int]] = []

    @register_fx_node_fix("onnx", **meta())
    def add_to_sub(module, node):
        if node.target is torch.add:
            visited.append(("root" if module is gm else "inner" if module is gm.inner else "?", node.args[1]))
            node.target = torch.sub
            return True
        return False

    assert apply_fx_node_fixes("onnx", gm) == [f"{__name__}.{add_to_sub.__qualname__}"]
    assert sorted(visited) == [("inner", 1), ("root", 10)]
    assert "torch.sub(x, 1)" in gm.inner.code
    assert "torch.sub(x, 10)" in gm.code
    x = torch.tensor([3.0])
    torch.testing.assert_close(gm(x), (x - 1) * (x - 10))


def test_inactive_or_other_backend_node_fixes_do_nothing(monkeypatch):
    gm = make_fx(_add_with_unused_mul)(torch.ones(1), torch.ones(1))
    code = gm.code

    def always(gm, node):
        node.target = aten.sub.Tensor
        return True

    register_fx_node_fix("onnx", **meta())(always)
    register_fx_node_fix("dynamo", **meta(versions={"torch": "<1"}))(always)
    assert apply_fx_node_fixes("dynamo", gm) == []
    assert apply_fx_node_fixes("executorch", gm) == []
    assert gm.code == code


def test_node_fix_error_names_the_fix():
    gm = make_fx(_add_with_unused_mul)(torch.ones(1), torch.ones(1))

    @register_fx_node_fix("onnx", **meta())
    def explode(gm, node):
        raise ValueError("bad node")

    with pytest.raises(ValueError, match="bad node") as info:
        apply_fx_node_fixes("onnx", gm)
    assert "explode" in info.value.__notes__[0]


class _Tiny(torch.nn.Module):
    def forward(self, x):
        return x.relu() + 1


def test_program_fix_called_once_with_the_program(monkeypatch):
    ep = torch.export.export(_Tiny(), (torch.randn(2, 3),))
    calls: list[object] = []

    @register_fx_program_fix("executorch", **meta())
    def record(exported_program):
        calls.append(exported_program)

    @register_fx_program_fix("executorch.cuda", **meta())
    def cuda_only(exported_program):
        calls.append("cuda")

    @register_fx_program_fix("executorch", **meta(versions={"torch": "<1"}))
    def too_old(exported_program):
        calls.append("old")

    assert apply_fx_program_fixes("executorch.xnnpack", ep) == [f"{__name__}.{record.__qualname__}"]
    assert len(calls) == 1 and calls[0] is ep


# ------------------------------------------------------------------------------------------
# reporting: entries, active, stale
# ------------------------------------------------------------------------------------------


def test_entries_filter_by_scope_and_kind(monkeypatch):
    fake_versions(monkeypatch, torch="2.13.0+cpu", onnxscript="0.7.2")
    register_fx_node_fix("executorch.xnnpack", **meta(versions={"torch": "<2.12"}))(lambda gm, n: False)

    @register_fx_program_fix("executorch", **meta(versions={"torch": "<2.14"}))
    def parent_fix(ep):
        return None

    @register_fx_program_fix("executorch.cuda", **meta())
    def cuda_fix(ep):
        return None

    @register_fx_node_fix("onnx", **meta(versions={"onnxscript": ">=0.7,<0.8"}))
    def onnx_fix(gm, node):
        return False

    got = entries("executorch.xnnpack")
    assert [(e.backend, e.name.rsplit(".", 1)[1]) for e in got] == [
        ("executorch", "parent_fix"),
        ("executorch.xnnpack", "<lambda>"),
    ]
    assert [e.is_active() for e in got] == [True, False]
    supported = {"torch": ">=2.12,<2.16", "onnxscript": ">=0.8"}
    assert [e.is_stale(supported) for e in got] == [False, True]
    assert [e.name for e in entries(kind="fx_node_fix")] == [
        got[1].name,
        f"{__name__}.{onnx_fix.__qualname__}",
    ]
    (onnx_entry,) = entries("onnx")
    assert onnx_entry.is_active() and onnx_entry.is_stale(supported)
    assert onnx_entry.kind == "fx_node_fix" and onnx_entry.paths == () and onnx_entry.issue == ISSUE
    assert onnx_entry.versions == {"onnxscript": ">=0.7,<0.8"}
    with pytest.raises(ValueError, match="kind"):
        entries(kind="patches")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("versions", "supported", "stale"),
    [
        ({"torch": "<2.12"}, {"torch": ">=2.12,<2.16"}, True),
        ({"torch": "<2.14"}, {"torch": ">=2.12,<2.16"}, False),
        ({"torch": "<=2.12"}, {"torch": ">=2.12,<2.16"}, False),
        ({"torch": "<2.12.1"}, {"torch": ">2.12,<2.16"}, False),  # 2.12.0.1 fits both
        ({"torch": ">=2.16"}, {"torch": ">=2.12,<2.16"}, True),
        ({"torch": "==2.13.*"}, {"torch": ">=2.14"}, True),
        ({"torch": "==2.13.*"}, {"torch": ">=2.12,<2.16"}, False),
        ({"torch": "~=2.13.1"}, {"torch": ">=2.12,<2.14"}, False),
        ({"torch": "<2.14", "onnxscript": ">=0.7,<0.8"}, {"torch": ">=2.12", "onnxscript": ">=0.8"}, True),
        ({"onnxscript": ">=0.7,<0.8"}, {"onnxscript": ">=0.8"}, True),
        ({"onnxscript": ">=0.7,<0.8"}, {"torch": ">=2.12"}, False),  # not judged without a range
        ({"ONNXScript": "<0.8"}, {"onnxscript": ">=0.8"}, True),  # names are normalised
    ],
)
def test_is_stale(versions, supported, stale):
    register_fx_program_fix("onnx", **meta(versions=versions))(lambda ep: None)
    (entry,) = entries()
    assert entry.is_stale(supported) is stale


def test_is_stale_extra_candidates():
    # the overlap of these ranges is only versions like 2.13.0.0.0.5, which no literal suggests
    register_fx_program_fix("onnx", **meta(versions={"torch": ">2.13"}))(lambda ep: None)
    (entry,) = entries()
    supported = {"torch": "<2.13.0.0.1"}
    assert entry.is_stale(supported) is True
    assert entry.is_stale(supported, candidates={"torch": ["2.13.0.0.0.5"]}) is False
