"""The workarounds of ``hfexport-onnx``, all entries of :mod:`hfexport.registry` under ``"onnx"``.

- :mod:`~hfexport_onnx.workarounds.patches`: patches (kind ``"patch"``), installed around capture
  and translation;
- :mod:`~hfexport_onnx.workarounds.fx_fixes`: FX node and program fixes of the captured program;
- :mod:`~hfexport_onnx.workarounds.translations`: custom aten -> ONNX translations (kind
  ``"onnx_translation"``, registered by this package);
- :mod:`~hfexport_onnx.workarounds.ir_fixes`: fixes of the translated ``onnx_ir`` model (kind
  ``"onnx_ir_fix"``, registered by this package);
- :mod:`~hfexport_onnx.workarounds.ort_layer_norm`: graph rewrites around slow ONNX Runtime kernels
  (kind ``"ort_kernel_fix"``, registered by this package, run by the export's ``ort_kernel_fixes``
  stage on float32 CPU graphs without quantization and by the ``int8-dynamic`` method).
"""
