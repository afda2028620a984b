"""The workarounds of ``hfexport-openvino``, entries of :mod:`hfexport.registry` under ``"openvino"``.

- :mod:`hfexport_openvino.workarounds.fx_fixes`: FX node fixes applied to the captured program
  before ``openvino.convert_model``, and the core's dense mixture-of-experts patch.
- :mod:`hfexport_openvino.workarounds.patches`: patches installed while the backend captures
  (model code whose traced program holds nodes the frontend cannot convert).
"""
