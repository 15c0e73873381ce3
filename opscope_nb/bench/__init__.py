"""The benchmark behind ``python bench.py``, importable section by section.

``python bench.py`` (or ``python -m opscope_nb.bench``) calls :func:`main`;
tests call :func:`run` or one ``sectionN(cfg, comp, res)`` on a small config.
Modules: :mod:`._util` (timing, errors, formatting), :mod:`.machine` (CPU,
caches, vendor, streaming bandwidth), :mod:`.matmul` (sections 1-6),
:mod:`.verdict` (section 7), :mod:`.formats` (section 8, every
format through ``PackedLinear``, streamed), :mod:`.peers` (section 9, ONNX Runtime), :mod:`.runner` (configs, command line, :func:`run`).
"""
from ._util import TIMING, Compile, rel_l2, time_group
from .machine import machine_info, stream_bandwidth
from .runner import ALL_SECTIONS, FULL, QUICK, SECTIONS, main, parse_sections, run
from .matmul import section1, section2, section3, section4, section5, section6
from .formats import section8
from .peers import section9
from .verdict import section7

__all__ = ["main", "run", "parse_sections", "FULL", "QUICK", "SECTIONS", "ALL_SECTIONS",
           "TIMING", "Compile", "rel_l2", "time_group", "machine_info",
           "stream_bandwidth", "section1", "section2", "section3", "section4",
           "section5", "section6", "section7", "section8", "section9"]
