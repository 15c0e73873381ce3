"""Measuring a weight matrix's options (layer 4): mining (:mod:`.mining`,
``profile_layer``), probes (:mod:`.probe`), truncated SVD (:mod:`.svd`),
decompositions (:mod:`.decompose`), calibration and sensitivity
(:mod:`.calib`) and the whole-checkpoint driver (:mod:`.checkpoint`).  GPTQ
rounding is a way of choosing a format's codes: :mod:`opscope_nb.formats.gptq`."""
