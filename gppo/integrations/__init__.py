"""Engine integrations: the GPPO objective inside verl and TRL, unchanged.

- `gppo.integrations.verl` (`pip install gppo[verl]`): policy-loss modes `gppo` and
  `gppo_<preset>` for verl 0.9, and `GPPOPolicyLossConfig` for Hydra overrides (docs/verl.md).
- `gppo.integrations.trl` (`pip install gppo[trl]`): `GPPOTrainer` and `GPPOTrainerConfig`, TRL's
  GRPOTrainer with the GPPO loss (docs/trl.md).

Each module imports its engine at import time; this package imports neither.
"""
