"""Runtime layouts of the ExecuTorch backend, registered with :func:`hfexport.layouts.register_layout`
when :mod:`hfexport_executorch` is imported.

- ``llm-runner`` (:mod:`hfexport_executorch.layouts.llm_runner`): ``model.pte`` + ``tokenizer.json``
  that ExecuTorch's own LLM runner (``executorch.extension.llm.runner.TextLLMRunner``, or the C++
  ``llama_main``-style runners built on ``create_text_llm_runner``) loads and generates with.
"""

from __future__ import annotations

from hfexport.layouts import Layout, register_layout

__all__ = ["LLM_RUNNER"]

LLM_RUNNER = register_layout(
    Layout(
        name="llm-runner",
        export_format="executorch",
        tasks=("text-generation",),
        runtime="executorch TextLLMRunner",
        description=(
            "model.pte (forward(tokens, input_pos) with the KV cache as mutable buffers, the runner's "
            "metadata methods) + tokenizer.json for ExecuTorch's LLM runner"
        ),
        writer="hfexport_executorch.layouts.llm_runner:write_llm_runner",
        needs_tokenizer=True,
        check="hfexport_executorch.layouts.llm_runner:refusal",
    )
)
