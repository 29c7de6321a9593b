"""Measurement above the runtime: the code that times layer units, local communication and short real engine runs
to calibrate the step-time model (:mod:`.units`, :mod:`.engine`), caches the result (:mod:`.measure`) and predicts
a model's step from it (:mod:`.predict`). It launches the engine, so it sits above :mod:`whale.runtime`; the front
end and the planner read only the cache (:mod:`whale.planner.calibration_cache`, keys by
:mod:`whale.frontend.unit_keys`)."""
