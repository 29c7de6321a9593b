"""The step-time model, in one place: analytic per-event costs (:mod:`.cost`), the search's default estimator
(:mod:`.estimate`), the whole-step simulator of a plan on calibrated costs (:mod:`.simulate`), the search's
estimator on those costs (:mod:`.calibrated`) and the seconds the memory techniques add (:mod:`.memory_time`)."""
