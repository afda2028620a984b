"""Child process of the scale benchmark: export a model folder with the reference exporter
(``transformers.exporters``, transformers 5.24) the way a user of that API does.

``python benchmarks/scale_reference.py BACKEND MODEL_DIR OUT_DIR``: load the folder with
``AutoModelForCausalLM.from_pretrained`` (its defaults: the checkpoint's dtype), sample inputs
from its tokenizer (the same two sentences hfexport's CLI uses, padded), the backend's config
with ``dynamic=True``, ``export``, ``save_pretrained``. The reference does not validate. Prints
one JSON line: seconds and peak RSS (bytes, ``ru_maxrss`` so far) after each phase, the model's
dtype and the input shape. The benchmark measures the whole process from outside.

Bench-only: hfexport never imports ``transformers.exporters``; this script does not import
hfexport, so the process holds only what the reference needs.
"""

from __future__ import annotations

import json
import resource
import sys
import time

#: the sample batch of ``hfexport.checkpoints.SAMPLE_SENTENCES`` (a test keeps the two equal)
SAMPLE_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Exported models must compute what the eager model computes.",
)

CONFIG_CLASSES = {
    "dynamo": "DynamoConfig",
    "onnx": "OnnxConfig",
    "executorch": "ExecutorchConfig",
    "openvino": "OpenVINOConfig",
}


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def main(argv: list[str]) -> int:
    """Export ``MODEL_DIR`` to ``OUT_DIR`` on ``BACKEND`` with the reference; print the phases as JSON."""
    if len(argv) != 3 or argv[0] not in CONFIG_CLASSES:
        print(f"usage: scale_reference.py {{{','.join(CONFIG_CLASSES)}}} MODEL_DIR OUT_DIR", file=sys.stderr)
        return 2
    backend, model_dir, out_dir = argv
    phases: dict[str, dict[str, float | int]] = {}
    start = time.perf_counter()

    def mark(name: str) -> None:
        nonlocal start
        now = time.perf_counter()
        phases[name] = {"seconds": round(now - start, 3), "peak_rss_bytes": _peak_bytes()}
        start = now

    from transformers import AutoModelForCausalLM, AutoTokenizer, exporters

    mark("import")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    inputs = dict(tokenizer(list(SAMPLE_SENTENCES), padding=True, return_tensors="pt"))
    mark("load")
    config = getattr(exporters, CONFIG_CLASSES[backend])(dynamic=True)
    exporter = exporters.AutoHfExporter.from_config(config)
    exported = exporter.export(model, inputs, config)
    mark("export")
    exported.save_pretrained(out_dir)
    mark("save")
    print(
        json.dumps(
            {
                "phases": phases,
                "model_dtype": str(model.dtype).removeprefix("torch."),
                "input_shape": list(inputs["input_ids"].shape),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
