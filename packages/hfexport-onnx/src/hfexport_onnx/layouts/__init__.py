"""Runtime layouts of the onnx backend: folders that a runtime's own loader reads.

Each module registers its :class:`hfexport.layouts.Layout` with
:func:`hfexport.layouts.register_layout` when imported; ``hfexport_onnx`` imports them, so
``hfexport export onnx --layout NAME`` finds them.
"""
