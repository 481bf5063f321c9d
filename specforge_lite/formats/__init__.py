"""What every export format shares and no method owns: the ``ExportFormat`` interface a format implements
(format.py, with ``ExportRefused``), what every layout writes alike and the folder written whole (layout.py), and
the check's report (report.py). Each method's formats, and a layout several servers read (EAGLE3's Llama layout),
are in its folder (methods/<name>/export), registered with the method; the entry points that write, read and check
a folder (export/) gather them by name. Nothing here imports a method."""

from .format import ExportFormat, ExportRefused
from .layout import PROVENANCE_KEY, UNKNOWN_LAYERS, ExportWriteError
from .report import Report

__all__ = ["PROVENANCE_KEY", "UNKNOWN_LAYERS", "ExportFormat", "ExportRefused", "ExportWriteError", "Report"]
