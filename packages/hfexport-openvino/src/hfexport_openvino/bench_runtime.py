"""OpenVINO GenAI as an ``hfexport bench`` folder runtime.

Claims a folder ``openvino_genai.LLMPipeline`` runs (``openvino_model.xml`` plus the converted
``openvino_tokenizer.xml`` / ``openvino_detokenizer.xml``): our ``--layout genai`` export and
optimum-intel's / NNCF's output alike. Generation is ``LLMPipeline.generate`` on token ids
(greedy); the text metrics come from the same IR run with ``openvino.Core`` (a stateful decoder:
``input_ids``, ``attention_mask``, ``position_ids``, ``beam_idx``, state reset per prefill).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hfexport.bench.runtimes import FolderRuntime, per_position_logits, register_folder_runtime

_NEEDED = ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml")


def claims(folder: Path) -> bool:
    """True for a folder ``LLMPipeline`` loads (the IR and both tokenizer models)."""
    return all((folder / name).is_file() for name in _NEEDED)


class LlmPipelineFolder:
    """One OpenVINO GenAI folder opened with ``LLMPipeline(folder, "CPU")`` (fp32 inference)."""

    logits_note = ""

    def __init__(self, folder: Path, threads: int) -> None:
        import openvino_genai as ov_genai

        self._folder = folder
        self._threads = int(threads)
        self._genai = ov_genai
        self.pipe = ov_genai.LLMPipeline(
            str(folder), "CPU", INFERENCE_NUM_THREADS=self._threads, INFERENCE_PRECISION_HINT="f32"
        )
        self._request: Any = None

    def _generate(self, ids: Sequence[int], max_new_tokens: int) -> Any:
        import numpy as np
        import openvino as ov

        config = self._genai.GenerationConfig()
        config.max_new_tokens = max_new_tokens
        config.do_sample = False
        tokens = np.asarray([list(ids)], dtype=np.int64)
        inputs = self._genai.TokenizedInputs(ov.Tensor(tokens), ov.Tensor(np.ones_like(tokens)))
        return self.pipe.generate(inputs, config)

    def generate(self, ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy new token ids (at most ``max_new_tokens``)."""
        return [int(t) for t in self._generate(ids, max_new_tokens).tokens[0]]

    def timed_generate(self, ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], float, float]:
        """Greedy generation timed by the pipeline's own perf metrics: ``(new ids, seconds to the
        first token, seconds of the whole generation)``."""
        result = self._generate(ids, max_new_tokens)
        metrics = result.perf_metrics
        first = metrics.get_ttft().mean / 1e3
        total = metrics.get_generate_duration().mean / 1e3
        return [int(t) for t in result.tokens[0]], first, total

    def logits(self, ids: Sequence[int]) -> Any:
        """Logits of one prefill over ``ids`` (float32 ``[len(ids), vocab]``), or ``None`` with a
        note when the IR returns only the last position's logits."""
        import numpy as np
        import openvino as ov

        if self._request is None:
            core = ov.Core()
            compiled = core.compile_model(
                str(self._folder / "openvino_model.xml"),
                "CPU",
                {"INFERENCE_NUM_THREADS": self._threads, "INFERENCE_PRECISION_HINT": "f32"},
            )
            self._request = compiled.create_infer_request()
        request = self._request
        request.reset_state()
        tokens = np.asarray([list(ids)], dtype=np.int64)
        feed: dict[str, Any] = {}
        for port in request.model_inputs:
            name = port.get_any_name()
            if name == "input_ids":
                feed[name] = tokens
            elif name == "attention_mask":
                feed[name] = np.ones_like(tokens)
            elif name == "position_ids":
                feed[name] = np.arange(tokens.shape[1], dtype=np.int64)[None]
            elif name == "beam_idx":
                feed[name] = np.zeros(1, dtype=np.int32)
            else:
                self.logits_note = f"the IR takes an input {name!r} the bench does not feed"
                return None
        request.infer(feed)
        logits, note = per_position_logits(request.get_tensor("logits").data, len(ids))
        self.logits_note = note
        return logits


def open_folder(folder: Path, threads: int) -> LlmPipelineFolder:
    """Opener of :data:`OPENVINO_GENAI`."""
    return LlmPipelineFolder(folder, threads)


#: OpenVINO GenAI folders (``--layout genai``, optimum-intel / NNCF output)
OPENVINO_GENAI = register_folder_runtime(
    FolderRuntime(
        name="openvino-genai",
        description="openvino_model.xml + openvino_tokenizer.xml + openvino_detokenizer.xml, run by openvino_genai.LLMPipeline",
        claims="hfexport_openvino.bench_runtime:claims",
        opener="hfexport_openvino.bench_runtime:open_folder",
        priority=10,
    )
)
