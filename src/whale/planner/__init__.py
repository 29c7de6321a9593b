"""Planning algorithms for real transformer shapes (issue 28): the GPT shape and its FLOPs, the activation and
model-state memory accounting of Korthikanti et al. 2022, a per-device-type roofline for compute time, the
legal split degrees, and the estimator that forces a published plan through Whale's step-time model."""
