"""The planner: pure functions that choose a :class:`~whale.plan.plan.Plan` (shares and placement, memory options,
experts, ZeRO sizing, the search, model descriptions) and the step-time model that ranks the choices
(:mod:`whale.planner.steptime`). It imports the contract (:mod:`whale.plan`) and the bottom modules (cluster,
config, units) and nothing above them; see ``tests/test_import_graph.py`` for the floors.

It also holds the planning of real transformer shapes (issue 28): the GPT shape and its FLOPs, the activation
and model-state memory accounting of Korthikanti et al. 2022, a per-device-type roofline for compute time, the
legal split degrees, and the estimator that forces a published plan through the step-time model."""
