"""The noise multipliers of recipes/privacy-dp.yaml: for each target epsilon, the z at which Opacus' RDP
accountant (the one fedlm reports with) reaches it at delta = 1e-5 after the run, for the protocol's own
sampling rate and number of releases.

    .venv/bin/python recipes/results/privacy_noise.py

Client level (DP-FedAvg): one release per round at q = clients_per_round / num_clients. Sample level (DP-SGD):
each client composes its own steps at q = batch_size / its examples; every client holds the same number of
examples here (IID), so the worst-off client is any of them.
"""

from __future__ import annotations

import math
import warnings

from opacus.accountants.utils import get_noise_multiplier

from fedlm.federation.opacus import epsilon

DELTA = 1e-5
TARGETS = (1.0, 3.0, 8.0)
ROUNDS, CLIENTS, CLIENTS_PER_ROUND = 3, 5, 5
EXAMPLES_PER_CLIENT, BATCH = 100, 32


def settings() -> dict[str, tuple[float, int]]:
    """(sample rate, steps) of each kind of DP as the recipe runs it."""
    steps_per_round = math.ceil(EXAMPLES_PER_CLIENT / BATCH)  # one local epoch, the last batch partial
    return {"client": (CLIENTS_PER_ROUND / CLIENTS, ROUNDS),
            "sample": (BATCH / EXAMPLES_PER_CLIENT, ROUNDS * steps_per_round)}


def main() -> None:
    warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
    for kind, (rate, steps) in settings().items():
        for target in TARGETS:
            z = get_noise_multiplier(target_epsilon=target, target_delta=DELTA, sample_rate=rate, steps=steps,
                                     accountant="rdp", epsilon_tolerance=0.01)
            z = round(z, 3)  # as written in the recipe
            print(f"{kind}: q={rate:.2f} steps={steps} target eps={target:g} -> z={z:.3f} "
                  f"(fedlm's accountant at that z: eps={epsilon(z, rate, steps, DELTA):.3f})")


if __name__ == "__main__":
    main()
