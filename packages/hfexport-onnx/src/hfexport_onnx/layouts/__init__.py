"""Runtime layouts of the ONNX backend (see :mod:`hfexport.layouts`).

Each module registers its layout with :func:`hfexport.layouts.register_layout` when imported;
``import hfexport_onnx`` imports them.
"""
