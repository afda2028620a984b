"""Recurrences keep their sequence axis: the patches of hfexport.workarounds.recurrences, per backend.

Three levels:

* each construct (Mamba's selective scan, RWKV's time mixing, RecurrentGemma's RG-LRU) captured
  alone under the backend's patches with a symbolic length, run at THREE sequence lengths and
  compared with transformers' eager loop (dynamo: the ``torch.export`` program, scan op; ONNX: the
  translated model in onnxruntime, an ONNX Scan);
* the same constructs in the chunked form ExecuTorch and OpenVINO get, as ``torch.export``
  programs over the whole declared length range;
* the models, tiny and seeded, through the normal exporter with ``dynamic=True``: the sample
  (batch 2, 8 tokens) and the exporter's derived second shape (another length) both match eager.

Default run: the constructs on dynamo, ONNX and in the chunked form, and one model per construct
(mamba, rwkv, recurrent_gemma) on dynamo and ONNX (about two minutes on an idle core).
``extended``: mamba2 (its chunk scan on whole chunks), falcon_mamba and jamba (copies of Mamba's
scan) on dynamo and ONNX, and the models on ExecuTorch and OpenVINO (minutes each).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

#: max abs difference allowed against eager, per backend (the backends' float32 defaults)
ATOL = {"dynamo": 1e-5, "onnx": 1e-4}
#: the capture sample's length, then the three lengths each construct is checked at
SAMPLE_LENGTH = 8
LENGTHS = (3, 8, 37)


def _load_backend_patches(backend: str) -> None:
    if backend == "dynamo":
        import hfexport_dynamo.workarounds.patches  # noqa: F401  (registers the "dynamo" patches)
    else:
        import hfexport_onnx.workarounds.patches  # noqa: F401  (registers the "onnx" patches)


class _MambaScan(torch.nn.Module):
    def forward(self, x, dt, B, C, z):
        from transformers.models.mamba import modeling_mamba

        A = -torch.arange(1, 5, dtype=torch.float32).expand(x.shape[1], 4)
        D = torch.linspace(0.5, 1.5, x.shape[1])
        bias = torch.linspace(-1.0, 1.0, x.shape[1])
        y, state = modeling_mamba.mamba_selective_scan(
            x, dt, A, B, C, D=D, z=z, delta_bias=bias, delta_softplus=True, return_last_state=True
        )
        return y, state

    @staticmethod
    def inputs(length: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        b, d, n = 2, 6, 4
        x, dt, z = (torch.randn(b, d, length, generator=g) for _ in range(3))
        B, C = (torch.randn(b, n, length, generator=g) for _ in range(2))
        return x, dt, B, C, z

    time_axes = (2, 2, 2, 2, 2)


class _RwkvTimeMixing(torch.nn.Module):
    def forward(self, key, value, num, den, mx):
        from transformers.models.rwkv import modeling_rwkv

        channels = key.shape[-1]
        decay = torch.linspace(-2.0, 1.0, channels)
        first = torch.linspace(0.5, -0.5, channels)
        out, state = modeling_rwkv.rwkv_linear_attention(decay, first, key, value, state=[num, den, mx])
        return out, *state

    @staticmethod
    def inputs(length: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        b, c = 2, 5
        key = torch.randn(b, length, c, generator=g) * 3
        value = torch.randn(b, length, c, generator=g)
        num, mx = torch.randn(b, c, generator=g), torch.randn(b, c, generator=g)
        den = torch.rand(b, c, generator=g) + 0.5
        return key, value, num, den, mx

    time_axes = (1, 1, None, None, None)


class _RgLru(torch.nn.Module):
    def forward(self, x, gate, reset, state):
        from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

        return RecurrentGemmaRglru._rnn_scan(None, x, gate, reset, state)

    @staticmethod
    def inputs(length: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        b, w = 2, 6
        x = torch.randn(b, length, w, generator=g)
        gate = torch.rand(b, length, w, generator=g)
        positions = torch.stack([torch.arange(length), torch.arange(length) + 3])
        return x, gate, positions[:, :, None] == 0, torch.randn(b, w, generator=g)

    time_axes = (1, 1, 1, None)


CONSTRUCTS = {"mamba_selective_scan": _MambaScan, "rwkv_time_mixing": _RwkvTimeMixing, "rg_lru": _RgLru}


def _dynamic_shapes(module: torch.nn.Module) -> tuple[dict[int, object] | None, ...]:
    length = torch.export.Dim("length", min=2, max=1024)
    return tuple(None if axis is None else {axis: length} for axis in module.time_axes)


@pytest.mark.parametrize("backend", ["dynamo", "onnx"])
@pytest.mark.parametrize("construct", sorted(CONSTRUCTS))
def test_construct_keeps_its_sequence_axis_and_matches_eager_at_three_lengths(backend, construct, tmp_path):
    from hfexport.registry import apply_patches

    _load_backend_patches(backend)
    module = CONSTRUCTS[construct]().eval()
    sample = module.inputs(SAMPLE_LENGTH, torch.Generator().manual_seed(0))
    with apply_patches(backend) as entries:
        assert any(construct.split("_")[0] in e.name for e in entries), [e.name for e in entries]
        if backend == "dynamo":
            program = torch.export.export(module, sample, dynamic_shapes=_dynamic_shapes(module))
        else:
            onnx_program = torch.onnx.export(
                module, sample, dynamic_shapes=_dynamic_shapes(module), dynamo=True
            )
    if backend == "dynamo":
        assert any(n.target is torch.ops.higher_order.scan for n in program.graph.nodes)
        run = program.module()
    else:
        import onnxruntime as ort

        path = tmp_path / f"{construct}.onnx"
        onnx_program.save(str(path))
        assert "Scan" in {node.op_type for node in onnx_program.model_proto.graph.node}
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]

        def run(*args):
            outs = session.run(None, {n: a.numpy() for n, a in zip(names, args, strict=True)})
            return tuple(torch.from_numpy(o) for o in outs)

    for length in LENGTHS:
        args = module.inputs(length, torch.Generator().manual_seed(length))
        with torch.no_grad():
            want = module(*args)  # eager: transformers' loop, unpatched
            got = run(*args)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            diff = (g.float() - w.float()).abs().max().item()
            assert diff <= ATOL[backend] * max(1.0, w.float().abs().max().item()), (
                construct,
                backend,
                length,
                diff,
            )


@pytest.mark.parametrize("construct", sorted(CONSTRUCTS))
def test_chunked_form_keeps_the_sequence_axis_and_matches_eager_at_three_lengths(construct):
    # The form ExecuTorch and OpenVINO get: loop-free, so its torch.export program must keep the length
    # symbolic by itself (no scan op), over chunk boundaries (CHUNK = 16: 3, 8 and 37 tokens span 1..3 chunks).
    from hfexport.registry import apply_patches, isolated_registry
    from hfexport.workarounds.recurrences import register_recurrences

    module = CONSTRUCTS[construct]().eval()
    sample = module.inputs(SAMPLE_LENGTH, torch.Generator().manual_seed(0))
    with isolated_registry():
        register_recurrences("chunked-check", form="chunked")
        with apply_patches("chunked-check"):
            program = torch.export.export(module, sample, dynamic_shapes=_dynamic_shapes(module))
    (bounds,) = program.range_constraints.values()
    assert (bounds.lower, bounds.upper) == (2, 1024)  # the whole declared range: nothing specialised
    assert not any(n.target is torch.ops.higher_order.scan for n in program.graph.nodes)
    for length in LENGTHS:
        args = module.inputs(length, torch.Generator().manual_seed(length))
        with torch.no_grad():
            want, got = module(*args), program.module()(*args)
        for g, w in zip(got, want, strict=True):
            diff = (g.float() - w.float()).abs().max().item()
            assert diff <= 1e-5 * max(1.0, w.float().abs().max().item()), (construct, length, diff)


class _Mamba2ChunkScan(torch.nn.Module):
    CHUNK = 4  # a small chunk, so the three lengths end inside, on and across chunk boundaries

    def forward(self, x, dt, B, C):
        from transformers.models.mamba2 import modeling_mamba2

        heads = x.shape[2]
        A = -torch.linspace(0.5, 2.0, heads)
        D = torch.linspace(0.5, 1.5, heads)
        bias = torch.linspace(-1.0, 1.0, heads)
        return modeling_mamba2.mamba2_chunk_scan(
            x, dt, A, B, C, self.CHUNK, D=D, dt_bias=bias, dt_softplus=True, return_final_states=True
        )

    @staticmethod
    def inputs(length: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        b, h, p, groups, n = 2, 4, 3, 2, 5
        x = torch.randn(b, length, h, p, generator=g)
        dt = torch.randn(b, length, h, generator=g)
        B, C = (torch.randn(b, length, groups, n, generator=g) for _ in range(2))
        return x, dt, B, C

    time_axes = (1, 1, 1, 1)


@pytest.mark.parametrize("backend", ["dynamo", "chunked-check"])
def test_mamba2_chunk_scan_keeps_its_sequence_axis_past_one_chunk_at_three_lengths(backend):
    # Without the whole-chunk padding the program is bounded below one chunk (its modulo and the branch on
    # it specialise the length), so 8 and 37 tokens (2 and 10 chunks of 4) would fail the length guard.
    from hfexport.registry import apply_patches, isolated_registry
    from hfexport.workarounds.recurrences import register_recurrences

    module = _Mamba2ChunkScan().eval()
    sample = module.inputs(SAMPLE_LENGTH - 1, torch.Generator().manual_seed(0))
    with isolated_registry():
        register_recurrences(backend, form="scan" if backend == "dynamo" else "chunked")
        with apply_patches(backend) as entries:
            assert any("mamba2" in e.name for e in entries), [e.name for e in entries]
            program = torch.export.export(module, sample, dynamic_shapes=_dynamic_shapes(module))
    first = program.graph_signature.user_inputs[0]
    (x,) = (n for n in program.graph.nodes if n.op == "placeholder" and n.name == first)
    bounds = program.range_constraints[x.meta["val"].shape[1].node.expr]
    assert (bounds.lower, bounds.upper) == (2, 1024)  # the whole declared range, not one chunk
    for length in LENGTHS:
        args = module.inputs(length, torch.Generator().manual_seed(length))
        with torch.no_grad():
            want, got = module(*args), program.module()(*args)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            diff = (g - w).abs().max().item()
            assert diff <= 1e-5 * max(1.0, w.abs().max().item()), (length, diff)


# --------------------------------------------------------------------------------------------
# The models, through the exporter
# --------------------------------------------------------------------------------------------

DEFAULT_MODELS = ("mamba", "rwkv", "recurrent_gemma")  # one per construct
EXTENDED_MODELS = ("mamba2", "falcon_mamba", "jamba")

#: ExecuTorch and OpenVINO get the chunked form; their runs are long (minutes per type): extended only.
#: rwkv on ExecuTorch needs its token shift without a negative pad width (portable constant_pad_nd, error
#: 0x12) and its weights rescaled before capture (register_time_shift_without_crop,
#: rwkv_rescaled_before_capture); recurrent_gemma on XNNPACK one transpose per consumer of its transposed
#: convolution slice (register_sliced_transpose_per_consumer).
EDGE_CASES = [
    *[("executorch", mt) for mt in ("mamba", "mamba2", "falcon_mamba", "jamba", "rwkv", "recurrent_gemma")],
    *[("openvino", mt) for mt in ("mamba", "mamba2", "falcon_mamba", "jamba", "rwkv", "recurrent_gemma")],
]

MODEL_CASES = [
    *[pytest.param(b, mt, id=f"{b}-{mt}") for mt in DEFAULT_MODELS for b in ("dynamo", "onnx")],
    *[
        pytest.param(b, mt, id=f"{b}-{mt}", marks=pytest.mark.extended)
        for mt in EXTENDED_MODELS
        for b in ("dynamo", "onnx")
    ],
]


def _config(backend: str):
    from hfexport.config import DynamoConfig, ExecutorchConfig, OnnxConfig, OpenvinoConfig

    configs = {
        "dynamo": DynamoConfig,
        "onnx": OnnxConfig,
        "executorch": ExecutorchConfig,
        "openvino": OpenvinoConfig,
    }
    return configs[backend](dynamic=True)


@pytest.mark.parametrize(("backend", "model_type"), MODEL_CASES)
def test_recurrent_model_exports_dynamic_and_matches_at_two_sequence_lengths(backend, model_type):
    from hfexport.auto import AutoHfExporter
    from hfexport.testing import tiny_model

    model, inputs = tiny_model(model_type, "text-generation", seed=0)
    assert inputs["input_ids"].shape == (2, SAMPLE_LENGTH)
    exporter = AutoHfExporter.from_config(_config(backend))
    exporter.export(model, inputs)
    report = exporter.last_report
    statuses = {s.name: s.status for s in report.stages}
    assert statuses["validate_second_shape"] == "ok", report.summary_lines()
    sample, second = report.validation["sample"], report.validation["second_shape"]
    assert sample[0]["name"] == "logits" and tuple(sample[0]["shape"]) == (
        2,
        SAMPLE_LENGTH,
        model.config.vocab_size,
    )
    assert second[0]["shape"][1] != SAMPLE_LENGTH  # a second sequence length ran
    for row in sample + second:
        assert row["ok"] and float(row["max_abs_diff"]) <= ATOL[backend], row


@pytest.mark.extended
@pytest.mark.parametrize(("backend", "model_type"), EDGE_CASES)
def test_recurrent_model_exports_dynamic_on_the_edge_backends(backend, model_type):
    # the chunked form: validated by the backend's runtime at the sample and at a second sequence length
    pytest.importorskip("executorch" if backend == "executorch" else "openvino")
    from hfexport.auto import AutoHfExporter
    from hfexport.testing import tiny_model

    model, inputs = tiny_model(model_type, "text-generation", seed=0)
    exporter = AutoHfExporter.from_config(_config(backend))
    exporter.export(model, inputs)
    report = exporter.last_report
    statuses = {s.name: s.status for s in report.stages}
    assert statuses["validate_second_shape"] == "ok", report.summary_lines()
    sample, second = report.validation["sample"], report.validation["second_shape"]
    assert second[0]["shape"][1] != SAMPLE_LENGTH
    assert all(row["ok"] for row in sample + second), sample + second


# --------------------------------------------------------------------------------------------
# Generation: prefill/decode components carrying the recurrent state (hfexport.generation.recurrent)
# --------------------------------------------------------------------------------------------

#: new tokens of each greedy comparison
NEW_TOKENS = 8
#: the two prompt lengths generation is compared at (the capture sample has SAMPLE_LENGTH tokens)
PROMPT_LENGTHS = (5, 13)

GENERATION_CASES = [
    *[pytest.param(b, "mamba", id=f"{b}-mamba") for b in ("dynamo", "onnx")],
    pytest.param("dynamo", "recurrent_gemma", id="dynamo-recurrent_gemma"),
    *[
        pytest.param(b, mt, id=f"{b}-{mt}", marks=pytest.mark.extended)
        for mt in ("falcon_mamba", "mamba2", "rwkv", "recurrent_gemma")
        for b in ("dynamo", "onnx")
        if (b, mt) != ("dynamo", "recurrent_gemma")
    ],
    # the chunked form in the edge runtimes (OpenVINO: the core's components, not its stateful decoder)
    *[
        pytest.param(b, "mamba", id=f"{b}-mamba", marks=pytest.mark.extended)
        for b in ("executorch", "openvino")
    ],
]


def _greedy_parity(exporter, artifacts, model) -> None:
    """The exported prefill/decode components generate the tokens of model.generate(do_sample=False)
    at two prompt lengths, with every step's logits equal to generate's within tolerance."""
    from hfexport.generation import GenerationRunner, callers_from_exporter
    from hfexport.testing.generation import check_greedy_parity

    runner = GenerationRunner(artifacts.plan, callers_from_exporter(exporter, artifacts))
    check_greedy_parity(runner, model, PROMPT_LENGTHS, new_tokens=NEW_TOKENS, atol=1e-4)


@pytest.mark.parametrize(("backend", "model_type"), GENERATION_CASES)
def test_recurrent_generation_components_carry_the_state_and_generate_like_generate(backend, model_type):
    if backend in ("executorch", "openvino"):
        pytest.importorskip(backend, reason=f"the {backend} runtime is not installed")
    from hfexport.auto import AutoHfExporter
    from hfexport.generation.recurrent import recurrent_state_names
    from hfexport.testing import tiny_model

    model, inputs = tiny_model(model_type, "text-generation", seed=0)
    exporter = AutoHfExporter.from_config(_config(backend))
    artifacts = exporter.export_for_generation(model, inputs)
    assert list(artifacts) == ["prefill", "decode"]
    names = [f"cache.{n}" for n in recurrent_state_names(model)]
    decode_io = artifacts.plan.io["decode"]
    # the decode step takes one token and every state tensor, and returns the logits and every new state
    extra = ["position_ids"] if model_type == "recurrent_gemma" else []  # its RG-LRU resets at position 0
    assert decode_io.tensor_paths == ["input_ids", *names, *extra]
    assert decode_io.outputs == ["logits", *names]
    assert artifacts.plan.io["prefill"].outputs == ["logits", *names]
    # the prefill is validated at a second prompt length, the decode step at its sample (one token)
    statuses = {s.name: s.status for s in artifacts.reports["prefill"].stages}
    assert statuses.get("validate_second_shape") == "ok", artifacts.reports["prefill"].summary_lines()
    second = artifacts.reports["prefill"].validation["second_shape"]
    assert second[0]["name"] == "logits" and second[0]["shape"][1] != SAMPLE_LENGTH
    decode_statuses = {s.name: s.status for s in artifacts.reports["decode"].stages}
    assert decode_statuses.get("validate") == "ok", artifacts.reports["decode"].summary_lines()
    _greedy_parity(exporter, artifacts, model)


def test_recurrent_generation_components_save_load_and_generate_from_the_folder(tmp_path):
    """The manifest of a mamba export round-trips: a runner loaded from the folder generates as
    model.generate does, without the eager model."""
    from hfexport.generation import generate_from_dir, save_components
    from hfexport.testing import tiny_model
    from hfexport_dynamo import DynamoExporter

    model, inputs = tiny_model("mamba", "text-generation", seed=0)
    exporter = DynamoExporter()
    artifacts = exporter.export_for_generation(model, inputs, _config("dynamo"))
    save_components(exporter, artifacts, tmp_path / "out", model=model)
    prompt = [5, 17, 42, 7, 99, 3]
    want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS)
    got = generate_from_dir(tmp_path / "out", prompt, max_new_tokens=NEW_TOKENS)
    assert torch.as_tensor(got).reshape(-1).tolist() == want[0, len(prompt) :].tolist()


def test_recurrent_generation_refuses_a_multi_token_decode():
    from hfexport.testing import tiny_model
    from hfexport_dynamo import DynamoExporter

    model, inputs = tiny_model("mamba", "text-generation", seed=0)
    with pytest.raises(Exception, match="one token at a time") as info:
        DynamoExporter().export_for_generation(model, inputs, multi_token_decode=True)
    assert isinstance(info.value, ValueError)


def test_the_cli_exports_and_generates_from_a_recurrent_model(tmp_path):
    """No refusal left: `hfexport export --task text-generation` writes the recurrent components and
    `hfexport generate` runs them (recurrent_gemma used to be refused up front)."""
    from typer.testing import CliRunner

    from hfexport.cli import app
    from hfexport.testing import tiny_model

    out = tmp_path / "out"
    env = {"HFEXPORT_ISOLATE": "0", "COLUMNS": "300"}
    result = CliRunner().invoke(
        app,
        ["export", "dynamo", str(out), "--model", "tiny:recurrent_gemma", "--task", "text-generation"],
        env=env,
    )
    assert result.exit_code == 0, result.output
    assert (out / "generation_manifest.json").is_file()
    model, _ = tiny_model("recurrent_gemma", "text-generation")
    prompt = [5, 17, 42, 7]
    want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=4)[
        0, len(prompt) :
    ].tolist()
    result = CliRunner().invoke(
        app,
        ["generate", str(out), "--input-ids", ",".join(map(str, prompt)), "--max-new-tokens", "4"],
        env=env,
    )
    assert result.exit_code == 0, result.output
    assert "tokens: " + " ".join(map(str, want)) in result.output, (want, result.output)
