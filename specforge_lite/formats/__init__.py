"""What every export format shares and no method owns: the ``ExportFormat`` class a format subclasses
(format.py, with ``ExportRefused``), the Llama-EAGLE3 layout's config and weight names and the folder written
whole (layout.py), and the check's report and the rules the Llama-draft layouts share (report.py, check.py).
Each method's formats are in its folder (methods/<name>/export), registered with the method; the entry points
that write, read and check a folder (export/) gather them by name. Nothing here imports a method."""

from .format import LLAMA_ARCHS, ExportFormat, ExportRefused
from .layout import PROVENANCE_KEY, UNKNOWN_LAYERS, ExportWriteError
from .report import Report

__all__ = ["LLAMA_ARCHS", "PROVENANCE_KEY", "UNKNOWN_LAYERS", "ExportFormat", "ExportRefused", "ExportWriteError",
           "Report"]
